"""Train a matrix-capsule model with EM routing and report.

  python -m experiments.matrix_capsnet --workdir=/tmp/em_mnist \\
      --config=experiments/configs/matrix_capsnet_mnist.py[:smoke]

Configs: matrix_capsnet_mnist.py (MNIST, Fashion-MNIST), and
matrix_capsnet_smallnorb.py (needs the smallNORB files: see its docstring).
Rerunning with the same --workdir resumes from the last checkpoint; the
summary goes to WORKDIR/summary.json, TensorBoard logs to WORKDIR/tensorboard.
"""

from experiments import launcher

if __name__ == '__main__':
  launcher.run(launcher.train, 'matrix_capsnet_mnist.py')
