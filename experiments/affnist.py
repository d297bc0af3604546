"""Train CapsNet and a CNN on digits placed on 40x40, test both on affNIST.

  python -m experiments.affnist --workdir=/tmp/affnist \\
      --config=experiments/configs/capsnet_affnist.py[:smoke|:cpu] \\
      [--config.affnist_dir=/path/to/affNIST]

Sabour et al. 2017, section 5.2. The CapsNet trains in WORKDIR/capsnet, then
the CNN in WORKDIR/baseline_cnn stops at the CapsNet's validation accuracy;
both are tested on expanded MNIST, on affNIST-like transformed MNIST test
digits and, with --config.affnist_dir, on the real affNIST test set.
Rerunning with the same --workdir resumes. Writes
WORKDIR/affnist_summary.json and WORKDIR/affnist_examples.png.
"""

from capsjax import sabour_experiments
from experiments import launcher

if __name__ == '__main__':
  launcher.run(sabour_experiments.run_affnist, 'capsnet_affnist.py')
