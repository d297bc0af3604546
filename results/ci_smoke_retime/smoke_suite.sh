source /work/venv/bin/activate
cd /work/main
rm -rf /work/runs/suite_s13
python - <<'PY'
from tests import test_affnist_train, conftest
import pathlib
print(test_affnist_train.write_affnist_file(pathlib.Path('/work/runs/affnist_s13'), conftest.MNIST))
PY
export CAPSJAX_NO_PROGRESS=1
export XLA_FLAGS="--xla_force_host_platform_device_count=4"
start=$(date +%s)
python -m experiments.reproduce --workdir=/work/runs/suite_s13 --suite=smoke --affnist_dir=/work/runs/affnist_s13
echo "suite wall $(( $(date +%s) - start )) s"
