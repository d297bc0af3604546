"""Train CapsNet (or the baseline CNN) on MultiMNIST and report.

  python -m experiments.multimnist --workdir=/tmp/capsnet_multimnist \\
      --config=experiments/configs/capsnet_multimnist.py[:smoke|:baseline|:cpu]

Sabour et al. 2017, section 6: two overlapping MNIST digits on 36x36; an
example is correct when the two highest scores are the two true classes.
Rerunning with the same --workdir resumes from the last checkpoint. Writes
WORKDIR/summary.json (the training run), WORKDIR/multimnist_summary.json
(test error beside the paper's) and, for a CapsNet,
WORKDIR/multimnist_reconstructions.png (inputs; the digits decoded from the
two longest capsules in red and green).
"""

from capsjax import sabour_experiments
from experiments import launcher

if __name__ == '__main__':
  launcher.run(sabour_experiments.run_multimnist, 'capsnet_multimnist.py')
