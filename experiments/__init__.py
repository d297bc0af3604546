"""The experiments: ``python -m experiments.NAME`` (thin: flags -> config ->
train -> report).

Every experiment's command runs XLA:CPU's Eigen convolutions rather than
YNNPACK's (``capsjax.prefer_eigen_convolutions``): ``launcher.run_command``
sets it once the flags are read, before the experiment can start JAX's
backend. Neither this package nor an experiment module imports JAX before
its flags are read (``benchmark`` aside, whose flags' defaults come from
``benchmarks.harness``), so ``--help`` and a mistyped flag are answered in
a fraction of a second (tests/test_training_vector_capsules.py).
"""
