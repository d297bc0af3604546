"""Train a model from its config and report: a built-in model's config, or
one of yours that names your model class (``config.model =
'my_package.my_models:MyCapsNet'``: docs/own_model.md).

  python -m experiments.train --workdir=/tmp/capsnet \\
      --config=experiments/configs/capsnet_mnist.py[:smoke]

Configs: capsnet_mnist.py (the default), capsnet_fashion_mnist.py,
baseline_cnn_mnist.py, efficient_capsnet_mnist.py, matrix_capsnet_mnist.py
(MNIST, Fashion-MNIST), and the papers' other data sets:
capsnet_smallnorb.py, capsnet_svhn.py, capsnet_cifar10.py (one model; its
ensemble of 7: experiments.capsnet_ensemble) and matrix_capsnet_smallnorb.py
(each needs its files: see its docstring). A config of your own model runs
where your model's module imports (from the folder that holds its package,
or with that folder on PYTHONPATH). Rerunning with the same --workdir
resumes from the last checkpoint. The summary (validation and test
accuracy, steps, wall time, images/s) is written to WORKDIR/summary.json;
TensorBoard logs to WORKDIR/tensorboard.
"""

from experiments import launcher

if __name__ == '__main__':
  launcher.run(launcher.train, 'capsnet_mnist.py')
