source /work/venv/bin/activate
cd /work/main
export CAPSJAX_NO_PROGRESS=1
export XLA_FLAGS="--xla_force_host_platform_device_count=4"
R=/work/runs/item4
rm -rf $R; mkdir -p $R
t=$(date +%s); python -m experiments.capsnet_mnist --workdir=$R/capsnet_900 --config=experiments/configs/capsnet_mnist.py:smoke --config.num_train_steps=900 > $R/capsnet_900.log 2>&1; echo "capsnet_900 $(( $(date +%s)-t )) s"
for seed in 0 1; do
t=$(date +%s); python -m experiments.matrix_capsnet --workdir=$R/em_1500_s$seed --config=experiments/configs/matrix_capsnet_mnist.py:smoke --config.num_train_steps=1500 --config.seed=$seed > $R/em_1500_s$seed.log 2>&1; echo "em_1500_s$seed $(( $(date +%s)-t )) s"
done
t=$(date +%s); python -m experiments.matrix_capsnet --workdir=$R/em_1035_s1 --config=experiments/configs/matrix_capsnet_mnist.py:smoke --config.seed=1 > $R/em_1035_s1.log 2>&1; echo "em_1035_s1 $(( $(date +%s)-t )) s"
