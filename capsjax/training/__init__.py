"""Training: one loop (``fit``) shared by the two trainers of the model
families (``capsjax.families``).

Modules, one concern each:
  state        the train state, optimiser and schedule, one gradient step,
               mixed precision, digit preprocessing; ``FamilySteps``.
  sharding     data parallelism (mesh, batches, multi-process start-up) and
               the deterministic data order.
  checkpoints  atomic orbax checkpoints; trained workdirs read back.
  metrics      TensorBoard and JSON-lines metrics, the progress bar, records.
  evaluation   accuracy and loss over a split, the last batch padded.
  loop         ``fit``: train, resume, select on validation, test, evaluate.
  vector_capsules, matrix_capsules
               the two trainers: jittable steps around the family's loss,
               preprocessing and the dataset of a run. vector_capsules
               trains CapsNet, Su's models and their baseline CNNs;
               matrix_capsules the matrix-capsule (EM) models.
  runs         ``train(config, workdir)`` by the model's family;
               ``load_context(workdir)`` for the evaluators.
  own_images   a run on your own images (shapes from the data, the
               memory checked first); ``predict`` on new image files.
  memory       a step's peak memory from its traced program.
"""

from capsjax.training.checkpoints import Checkpointer
from capsjax.training.checkpoints import load_trained_model
from capsjax.training.checkpoints import read_workdir_config
from capsjax.training.loop import TrainingDiverged
from capsjax.training.loop import check_config
from capsjax.training.loop import fit
from capsjax.training.metrics import environment
from capsjax.training.metrics import write_json_atomic
from capsjax.training.own_images import predict
from capsjax.training.runs import family
from capsjax.training.runs import load_context
from capsjax.training.runs import train
from capsjax.training.state import FamilySteps
from capsjax.training.state import TrainState

__all__ = (
    'Checkpointer',
    'FamilySteps',
    'TrainState',
    'TrainingDiverged',
    'check_config',
    'environment',
    'family',
    'fit',
    'load_context',
    'load_trained_model',
    'predict',
    'read_workdir_config',
    'train',
    'write_json_atomic',
)
