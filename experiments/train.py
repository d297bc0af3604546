"""Train any config: a built-in model's, or one of yours that names your
model class (``config.model = 'my_package.my_models:MyCapsNet'``).

  python -m experiments.train --workdir=/tmp/mine \\
      --config=examples/two_layer_capsnet.py

Run it where your model's module imports (from the folder that holds its
package, or with that folder on PYTHONPATH). The same as any experiment:
rerunning with the same --workdir resumes; the summary is written to
WORKDIR/summary.json. How to write the model and its config:
docs/own_model.md.
"""

from experiments import launcher

if __name__ == '__main__':
  launcher.run(launcher.train, 'capsnet_mnist.py')
