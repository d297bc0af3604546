"""A model from outside capsjax through the whole pipeline (docs/own_model.md).

The models are in tests/user_models.py, a module of no capsjax package: a
small capsule network, a factory of a wider one, and three that break the
contract. The registry holds the built-in models and yours alike; a config
names yours as 'module:Class'; a run trains, stops at Ctrl-C, resumes,
selects on validation and runs its evaluators; its workdir loads in a new
process that imports the module and says which module to import in one
that cannot.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from capsjax import families
from capsjax import models
from capsjax import training
from capsjax.evaluators import ensemble
from capsjax.training import checkpoints
from capsjax.training import state as state_lib
from tests import conftest
from tests import user_models
from tests.conftest import REPO
from tests.helpers import write_tiny_mnist

CONFIG = os.path.join(REPO, 'tests', 'user_models.py')


@pytest.fixture
def registry(monkeypatch):
  """The registry, restored after the test."""
  monkeypatch.setattr(models, '_REGISTRY', dict(models._REGISTRY))
  return models._REGISTRY


def _abstract(name, **options):
  return nnx.eval_shape(
      lambda: models.create_model(name, rngs=nnx.Rngs(0), **options))


# ----------------------------------------------------------------------------
# One registry: names, paths, options, families.


def test_built_in_names_and_paths_resolve_through_the_one_registry(registry):
  assert models.list_models() == models.BUILT_IN_MODELS
  assert models.model_class('capsnet') is models.CapsNet
  # A path to a class, built-in or not, needs no registering.
  assert models.model_class('capsjax.models:CapsNet') is models.CapsNet
  assert models.model_class(user_models.MODEL) is user_models.TinyCapsNet
  models.register('tiny', user_models.TinyCapsNet)
  assert 'tiny' in models.list_models()
  by_name, by_path = _abstract('tiny'), _abstract(user_models.MODEL)
  assert type(by_name) is type(by_path) is user_models.TinyCapsNet
  assert models.count_params(by_name) == models.count_params(by_path) > 0
  # A workdir records a name registered from outside capsjax as its path.
  assert models.portable_name('tiny') == user_models.MODEL
  assert models.portable_name('capsnet') == 'capsnet'
  assert models.portable_name(user_models.MODEL) == user_models.MODEL


def test_options_of_your_model_are_checked_as_the_built_ins_are():
  assert models.model_options(user_models.MODEL) == {
      'input_shape': (28, 28, 1), 'num_classes': 10, 'channels': 8,
      'primary_types': 2, 'class_dim': 8}
  with pytest.raises(ValueError) as error:
    _abstract(user_models.MODEL, chanels=4)
  assert str(error.value) == (
      f"unknown option(s) ['chanels'] for model '{user_models.MODEL}'; valid "
      f'options: channels, class_dim, input_shape, num_classes, '
      f'primary_types.')
  # A factory's options are its own keywords.
  factory = 'tests.user_models:wide_tiny_capsnet'
  assert set(models.model_options(factory)) == {'input_shape', 'num_classes'}
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['channels'\]"):
    _abstract(factory, channels=4)
  assert _abstract(factory).conv.kernel.shape == (5, 5, 1, 16)


def test_register_refuses_what_it_could_not_build_or_find_again(registry):
  with pytest.raises(ValueError, match="holds ':', which marks an import"):
    models.register('a:b', user_models.TinyCapsNet)
  with pytest.raises(ValueError, match="'capsnet' is taken by "
                     'capsjax.models:CapsNet'):
    models.register('capsnet', user_models.TinyCapsNet)
  with pytest.raises(ValueError, match='takes no keyword rngs'):
    models.register('no_rngs', lambda width=1: None)
  with pytest.raises(ValueError, match='not a flax.nnx.Module subclass'):
    models.register('not_a_module', dict)
  # The same definition again (a notebook cell run twice) is no conflict.
  models.register('tiny', user_models.TinyCapsNet)
  models.register('tiny', user_models.TinyCapsNet)


def test_a_model_from_python_must_be_importable_by_its_name():
  assert models.import_path(user_models.TinyCapsNet) == user_models.MODEL
  assert models.import_path(user_models.wide_tiny_capsnet) == (
      'tests.user_models:wide_tiny_capsnet')

  class Local(user_models.TinyCapsNet):
    pass

  for unnamed in (Local, lambda *, rngs: user_models.TinyCapsNet(rngs=rngs)):
    with pytest.raises(ValueError, match='define the model class or '
                       'function at the top level of a module'):
      models.import_path(unnamed)


@pytest.mark.parametrize('path,error,message', [
    ('no_such_package.models:Net', models.ModelNotFound,
     "cannot import module 'no_such_package.models' of model "
     "'no_such_package.models:Net' \\(No module named 'no_such_package'\\): "
     'install it, or put the folder it is in on PYTHONPATH'),
    ('tests.user_models:Nope', models.ModelNotFound,
     "module tests.user_models \\(.*user_models.py\\) has no 'Nope'; its "
     'model classes: NoFamilyCapsNet, NoScoresCapsNet, TinyCapsNet.'),
    ('tests.user_models:', ValueError, 'must be module:Class'),
    ('tests.user_models:MODEL', ValueError,
     'neither a model class nor a function'),
])
def test_a_wrong_path_names_what_is_missing(path, error, message):
  with pytest.raises(error, match=message):
    models.model_class(path)


def test_the_family_comes_from_FAMILY_or_the_factory_s_class():
  assert families.of(user_models.MODEL) is families.of('capsnet')
  assert families.of('tests.user_models:wide_tiny_capsnet') is families.of(
      'capsnet')
  with pytest.raises(ValueError) as error:
    families.of('tests.user_models:NoFamilyCapsNet')
  message = str(error.value)
  assert '\n' not in message
  assert message.startswith('NoFamilyCapsNet declares no model family '
                            '(FAMILY = None); set the class attribute FAMILY')
  # Every family, and what each reads of the outputs.
  for family in ('capsnet', 'cnn', 'two_digit', 'em'):
    assert f"'{family}': 'class_scores' [B, K]" in message
  assert "'reconstructions' [B, H*W*C]" in message


def _config(model, **overrides):
  config = user_models.get_config()
  config.model = model
  config.update(overrides)
  return config


def test_outputs_are_checked_against_what_the_family_reads():
  state_lib.check_model(_config(user_models.MODEL), (28, 28, 1), 10)
  with pytest.raises(ValueError) as error:
    state_lib.check_model(_config('tests.user_models:NoScoresCapsNet'),
                          (28, 28, 1), 10)
  assert str(error.value).startswith(
      "model 'tests.user_models:NoScoresCapsNet' returned no 'class_scores' "
      "(its outputs: coupling, lengths, reconstructions); a 'capsnet' model "
      "returns 'class_scores' [B, K], capsule lengths")
  with pytest.raises(ValueError, match=r"'class_scores' has shape \(2, 10\) "
                     r'for 2 images of 5 classes, expected \[B, K\] = '
                     r'\[2, 5\]'):
    state_lib.check_model(_config(user_models.MODEL), (28, 28, 1), 5)
  family = families.of('capsnet')
  scores = jax.ShapeDtypeStruct((2, 10), jnp.float32)
  with pytest.raises(ValueError, match=r"'reconstructions' has shape \(2, "
                     r'100\) for images \(2, 28, 28, 1\), expected '
                     r'\[B, H\*W\*C\] = \[2, 784\]'):
    family.check_outputs({'class_scores': scores, 'reconstructions':
                          jax.ShapeDtypeStruct((2, 100), jnp.float32)},
                         (2, 28, 28, 1), 10, 'm')
  with pytest.raises(ValueError, match='returned a tuple, not a dict'):
    family.check_outputs((scores,), (2, 28, 28, 1), 10, 'm')


def test_a_workdir_whose_module_is_gone_says_which_to_import(tmp_path):
  config = _config('gone_package.my_models:TinyCapsNet')
  (tmp_path / 'config.json').write_text(config.to_json())
  with pytest.raises(models.ModelNotFound) as error:
    training.load_context(str(tmp_path))
  assert str(error.value).startswith(
      f"{tmp_path} holds a model from outside capsjax, 'gone_package."
      f"my_models:TinyCapsNet': cannot import module 'gone_package."
      f"my_models'")
  assert '`import gone_package.my_models` works' in str(error.value)


# ----------------------------------------------------------------------------
# The pipeline: the launcher, Python, resume, selection, evaluators, a new
# process, own images and --predict.


def _run(*args, cwd=REPO, timeout=300):
  return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True,
                        text=True, timeout=timeout,
                        env=conftest.training_env())


def _train_command(workdir, data_dir, *flags):
  return ['-m', 'experiments.train', f'--workdir={workdir}',
          f'--config={CONFIG}', f'--config.data_dir={data_dir}', *flags]


@pytest.fixture(scope='module')
def tiny_data(tmp_path_factory):
  return write_tiny_mnist(tmp_path_factory.mktemp('tiny_mnist'))


@pytest.mark.slow
@pytest.mark.parametrize('model,message', [
    ('tests.user_models:Nope', "error: ModelNotFound: module tests."
     "user_models ("),
    ('tests.user_models:NoFamilyCapsNet', 'error: ValueError: '
     'NoFamilyCapsNet declares no model family (FAMILY = None)'),
    ('tests.user_models:NoScoresCapsNet', "error: ValueError: model 'tests."
     "user_models:NoScoresCapsNet' returned no 'class_scores'"),
])
def test_a_broken_model_is_one_line_and_exit_2_before_training(
    tmp_path, tiny_data, model, message):
  workdir = tmp_path / 'work'
  out = _run(*_train_command(workdir, tiny_data, f'--config.model={model}'))
  assert out.returncode == 2, out.stdout + out.stderr
  assert out.stderr.count('\n') == 1 and out.stderr.startswith(message), (
      out.stderr)
  assert 'Starting fresh' not in out.stdout
  assert not workdir.exists()  # nothing trained, nothing written


def _validations(workdir):
  """step -> validation accuracy, from metrics.jsonl."""
  found = {}
  for line in (workdir / 'metrics.jsonl').read_text().splitlines():
    record = json.loads(line)
    if 'validation/accuracy' in record:
      found[record['step']] = record['validation/accuracy']
  return found


def _stop_with_ctrl_c(workdir, data_dir):
  """Launches a long run, sends SIGINT once it logs: the step saved."""
  proc = subprocess.Popen(
      [sys.executable, *_train_command(workdir, data_dir,
                                       '--config.num_train_steps=100000')],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env=conftest.training_env())
  metrics = workdir / 'metrics.jsonl'
  deadline = time.monotonic() + 300
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert proc.poll() is None and time.monotonic() < deadline, (
        proc.communicate()[0])
    time.sleep(0.2)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signal.SIGINT, out
  return checkpoints.Checkpointer(str(workdir / 'checkpoints')).latest_step()


@pytest.mark.slow
def test_your_model_trains_resumes_selects_and_evaluates_as_built_ins_do(
    tmp_path, tiny_data):
  # By config, through the launcher: stopped by Ctrl-C, then resumed.
  by_config = tmp_path / 'by_config'
  stopped = _stop_with_ctrl_c(by_config, tiny_data)
  assert stopped >= 3
  out = _run(*_train_command(by_config, tiny_data,
                             f'--config.num_train_steps={stopped + 10}'))
  assert out.returncode == 0, out.stdout + out.stderr
  assert (f'Resuming from the checkpoint of step {stopped} in {by_config}.'
          in out.stdout)
  summary = json.load(open(by_config / 'summary.json'))
  assert summary['model'] == user_models.MODEL
  assert summary['steps'] == stopped + 10
  # Selected on validation: the first step of the best validation accuracy.
  validations = _validations(by_config)
  best = max(validations.values())
  assert summary['selected_step'] == min(
      step for step, accuracy in validations.items() if accuracy == best)
  # The config's evaluator ran on the selected model: the test accuracy.
  per_class = summary['evals']['per_class']
  assert per_class['accuracy'] == pytest.approx(summary['test']['accuracy'])
  assert per_class['num_examples'] == 40

  # From Python, with a factory function in place of config.model.
  by_python = tmp_path / 'by_python'
  config = user_models.get_config()
  config.data_dir = tiny_data
  python_summary = training.train(config, str(by_python),
                                  model=user_models.wide_tiny_capsnet)
  assert python_summary['steps'] == 20
  saved = json.load(open(by_python / 'config.json'))
  assert saved['model'] == 'tests.user_models:wide_tiny_capsnet'

  # An ensemble of the two, each reloaded from its workdir: each member's
  # accuracy is the test accuracy its run reported.
  result = ensemble.ensemble_workdirs(
      [str(by_config), str(by_python)], load_context=training.load_context)
  assert result['test']['num_models'] == 2
  np.testing.assert_allclose(
      result['test']['member_accuracies'],
      [summary['test']['accuracy'], python_summary['test']['accuracy']])


def _image_folder(root):
  """Three classes of 8 small colour images each, with a stripe per class."""
  from PIL import Image
  for k, name in enumerate(('apple', 'kiwi', 'plum')):
    (root / name).mkdir(parents=True)
    for i in range(8):
      image = np.full((20 + i, 18, 3), 40 * k, np.uint8)
      image[::2, :, k] = 250
      Image.fromarray(image).save(root / name / f'{i}.png')
  return root


@pytest.mark.slow
def test_your_model_on_your_images_predicts_in_a_new_process(tmp_path,
                                                            capsys):
  images = _image_folder(tmp_path / 'images')
  workdir = tmp_path / 'work'
  config = user_models.get_config('own_images')
  config.images = str(images)
  summary = training.train(config, str(workdir))
  assert summary['model'] == user_models.MODEL
  # Its size, said before the first step: 2x2 positions of 2 primary types
  # (20 -> 8 -> 2 pixels), each voting for the 3 classes.
  assert ('capsules routed to the class capsules, 24 votes per image; '
          '20x20x3 images, 3 classes.') in capsys.readouterr().out
  assert summary['evals']['per_class']['class_names'] == [
      'apple', 'kiwi', 'plum']
  # A new process imports tests.user_models (run from the repository) and
  # predicts with the trained model.
  out = _run('-m', 'experiments.own_images', f'--workdir={workdir}',
             f'--predict={images / "kiwi"}')
  assert out.returncode == 0, out.stderr
  lines = out.stdout.strip().splitlines()
  assert lines[0] == '# file\tclass\tcapsule length'
  assert len(lines) == 1 + 8
  context = training.load_context(str(workdir))
  for line in lines[1:]:
    path, name, length = line.split('\t')
    assert name in ('apple', 'kiwi', 'plum')
    # The score this process computes for the same file.
    [here] = training.predict(context, [path])
    assert here.class_name == name
    assert float(length) == pytest.approx(here.score, abs=1e-4)
  # A process that cannot import the module is told which one to import.
  cannot = _run('-c', 'import sys; sys.modules["tests"] = None; '
                'from capsjax import training; '
                f'training.load_context({str(workdir)!r})')
  assert cannot.returncode == 1
  last = cannot.stderr.strip().splitlines()[-1]
  assert last.startswith(
      f"capsjax.models.ModelNotFound: {workdir} holds a model from outside "
      f"capsjax, 'tests.user_models:TinyCapsNet': cannot import module "
      f"'tests.user_models'"), last


# ----------------------------------------------------------------------------
# The example of docs/own_model.md.


def _documented_command() -> list[str]:
  """docs/own_model.md's bash block after ``<!-- own-model-command -->``."""
  text = open(os.path.join(REPO, 'docs', 'own_model.md')).read()
  block = text.split('<!-- own-model-command -->', 1)[1]
  command = block.split('```bash\n', 1)[1].split('```', 1)[0]
  return command.replace('\\\n', ' ').split()


def test_the_example_meets_the_contract_on_both_of_its_datasets():
  from examples import two_layer_capsnet as example
  command = _documented_command()
  assert command[:3] == ['python', '-m', 'experiments.train']
  assert '--config=examples/two_layer_capsnet.py' in command
  config = example.get_config()
  assert models.model_class(config.model) is example.TwoLayerCapsNet
  assert families.of(config.model) is families.of('capsnet')
  state_lib.check_model(config, (28, 28, 1), 10)  # Fashion-MNIST
  # On own images the data sets the shapes: 32x32 colour, 3 classes.
  mine = example.get_config('own_images')
  mine.model_options.update(input_shape=(32, 32, 3), num_classes=3)
  state_lib.check_model(mine, (32, 32, 3), 3)


@pytest.mark.slow
def test_config_help_explains_your_model_s_options():
  out = _run('-m', 'experiments.train', '--workdir=unused',
             '--config=examples/two_layer_capsnet.py', '--config_help')
  assert out.returncode == 0, out.stderr
  assert ('model_options.conv_channels = 64  # option conv_channels of '
          'examples.two_layer_capsnet.TwoLayerCapsNet (default 64; its '
          'docstring says what it does)') in out.stdout, out.stdout
