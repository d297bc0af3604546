"""Train a dynamic-routing model (CapsNet or the baseline CNN) and report.

  python -m experiments.capsnet_mnist --workdir=/tmp/capsnet \\
      --config=experiments/configs/capsnet_mnist.py[:smoke]

Configs: capsnet_mnist.py, capsnet_fashion_mnist.py, baseline_cnn_mnist.py,
and section 7's capsnet_smallnorb.py, capsnet_svhn.py and capsnet_cifar10.py
(one model; its ensemble of 7: experiments.capsnet_ensemble).
Rerunning with the same --workdir resumes from the last checkpoint. The
summary (validation and test accuracy, steps, wall time, images/s) is
written to WORKDIR/summary.json; TensorBoard logs to WORKDIR/tensorboard.
"""

from experiments import launcher

if __name__ == '__main__':
  launcher.run(launcher.train, 'capsnet_mnist.py')
