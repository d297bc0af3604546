"""The shipped trained models (capsjax.pretrained): files, digests, loading,
their accuracy on MNIST's test images, the command line and the README's
command."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from capsjax import pretrained
from capsjax.data import read_idx
from tests import conftest
from tests.conftest import REPO

MAX_BYTES = 5 * 2**20
# MNIST test images the accuracy check reads.
NUM_IMAGES = 500


def _mnist_test(num: int) -> tuple[np.ndarray, np.ndarray]:
  """The first ``num`` MNIST test images (uint8 [N, 28, 28, 1]) and labels."""
  images, labels = (read_idx(os.path.join(
      conftest.MNIST, f't10k-{kind}-ubyte.gz'))[:num]
      for kind in ('images-idx3', 'labels-idx1'))
  return images.reshape(num, 28, 28, 1), labels


@pytest.fixture(scope='module')
def loaded():
  """name -> (model, info) of every shipped model, loaded once."""
  return {name: pretrained.load(name) for name in pretrained.MODELS}


def test_every_entry_has_small_files_matching_its_digest():
  for name, entry in pretrained.MODELS.items():
    npz_path, json_path = pretrained.paths(name)
    assert npz_path.is_file() and json_path.is_file(), name
    assert npz_path.stat().st_size < MAX_BYTES, name
    assert pretrained.file_sha256(npz_path) == entry.sha256, name
    # The JSON beside it records the same digest, and the stored dtype.
    info = pretrained._read_info(name)
    assert info['sha256'] == entry.sha256, name
    assert pretrained.info_sha256(info) == entry.info_sha256, name
    with np.load(npz_path) as stored:
      assert {str(stored[key].dtype) for key in stored.files} == {
          info['dtype']}, name


def test_pip_install_ships_the_files():
  """pyproject's package-data patterns name every shipped file."""
  with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
    patterns = tomllib.load(f)['tool']['setuptools']['package-data'][
        'capsjax']
  package = Path(REPO) / 'capsjax'
  shipped = {p for pattern in patterns for p in package.glob(pattern)}
  for name in pretrained.MODELS:
    for path in pretrained.paths(name):
      assert path in shipped, f'{path} is not in package-data'


def test_available_lists_every_model_in_a_line():
  listed = pretrained.available()
  assert set(listed) == set(pretrained.MODELS)
  assert all(text and '\n' not in text for text in listed.values())
  with pytest.raises(KeyError, match='available: ') as error:
    pretrained.load('resnet50')
  assert all(name in str(error.value) for name in pretrained.MODELS)


@conftest.needs_mnist
def test_loaded_models_classify_mnist_test_images_as_recorded(loaded):
  """Accuracy on the first 500 test images at least the recorded test
  accuracy less three standard errors of a 500-image sample (about 2.2-2.5
  points for these models)."""
  images, labels = _mnist_test(NUM_IMAGES)
  for name, (model, info) in loaded.items():
    assert info['classes'] == [str(k) for k in range(10)]
    assert (info['image_size'], info['channels']) == (28, 1)
    assert info['commit'] and 'python -m experiments.' in info['command']
    recorded = info['test_accuracy']
    floor = recorded - 3 * math.sqrt(recorded * (1 - recorded) / NUM_IMAGES)
    scores = pretrained.predict_scores(model, info, images)
    accuracy = float(np.mean(np.argmax(scores, -1) == labels))
    assert accuracy >= floor, (name, accuracy, floor)


def test_a_corrupted_copy_fails_the_digest_check(tmp_path, monkeypatch):
  name = 'matrix_capsnet_mnist_smoke'
  for path in pretrained.paths(name):
    shutil.copy(path, tmp_path)
  copy = tmp_path / f'{name}.npz'
  data = bytearray(copy.read_bytes())
  data[len(data) // 2] ^= 0xFF
  copy.write_bytes(bytes(data))
  monkeypatch.setattr(pretrained, 'MODELS_DIR', tmp_path)
  expected = pretrained.MODELS[name].sha256
  with pytest.raises(pretrained.DigestMismatch) as error:
    pretrained.load(name)
  message = str(error.value)
  assert str(copy) in message and expected in message
  assert pretrained.file_sha256(copy) in message


@conftest.needs_mnist
def test_an_edited_config_fails_its_digest_and_line_endings_do_not(
    tmp_path, monkeypatch):
  """The .json builds the model: a changed routing-iteration count (same
  parameter shapes, other outputs) is refused; the same content with CRLF
  line endings (a Windows checkout) loads."""
  name = 'capsnet_mnist_smoke'
  for path in pretrained.paths(name):
    shutil.copy(path, tmp_path)
  monkeypatch.setattr(pretrained, 'MODELS_DIR', tmp_path)
  json_path = tmp_path / f'{name}.json'
  text = json_path.read_text()
  json_path.write_bytes(text.replace('\n', '\r\n').encode())
  assert pretrained.load(name)[1]['sha256'] == pretrained.MODELS[name].sha256
  info = json.loads(text)
  info['config']['model_options']['num_iterations'] = 1
  json_path.write_text(json.dumps(info, indent=1))
  with pytest.raises(pretrained.DigestMismatch, match=str(json_path)):
    pretrained.load(name)


def test_a_weight_beyond_float16_is_not_exported_as_inf(tmp_path):
  path = tmp_path / 'm.npz'
  with pytest.raises(ValueError, match=r"\['w'\] is not finite as float16"):
    pretrained.save_params({'w': np.array([1e6], np.float32)}, path,
                           'float16')
  assert not path.exists()
  pretrained.save_params({'w': np.array([1e6], np.float32)}, path)
  with np.load(path) as stored:
    assert stored["['w']"][0] == 1e6


def test_mnist_like_keeps_an_mnist_digit_and_inverts_paper():
  grey = _mnist_test(1)[0][0, ..., 0]
  assert np.abs(pretrained.mnist_like(grey, (28, 28)).astype(int) -
                grey).max() <= 1
  # Dark ink on light paper, the digit small in a wide image.
  paper = np.full((84, 84), 230, np.uint8)
  paper[30:58, 40:68] = 230 - grey * 0.9
  out = pretrained.mnist_like(paper, (168, 84))
  assert out.shape == (28, 28) and out.dtype == np.uint8
  assert out[0].max() == 0 and out.max() > 200
  # Fitted into 20x20 and centred by mass, as MNIST's digits.
  rows, cols = np.nonzero(out)
  assert max(np.ptp(rows), np.ptp(cols)) + 1 <= 20
  mass = out.astype(float) / out.sum()
  centre = (mass.sum(1) @ np.arange(28), mass.sum(0) @ np.arange(28))
  assert np.allclose(centre, 14, atol=0.6)


def test_a_phone_photo_turned_by_exif_keeps_its_digit_upright_and_thin(
    tmp_path):
  """A "1" (a dark bar 10 wide, 80 tall on paper 60 x 120) stored a quarter
  turn round with EXIF orientation 6, as phones store portrait photos,
  reads as the same thin upright digit as the upright file: the aspect
  ratio is the shown image's, not the stored raster's."""
  shown = np.full((120, 60), 235, np.uint8)
  shown[20:100, 25:35] = 20
  upright = tmp_path / 'upright.png'
  Image.fromarray(shown).save(upright)
  turned = tmp_path / 'turned.jpg'
  exif = Image.Exif()
  exif[0x0112] = 6  # shown = stored turned 90 degrees clockwise
  Image.fromarray(shown).transpose(Image.Transpose.ROTATE_90).save(
      turned, exif=exif.tobytes(), quality=95)
  digits, kept = pretrained.read_digits([upright, turned])
  assert kept == [upright, turned]
  for digit in digits[..., 0]:
    rows, cols = np.nonzero(digit > 64)
    assert np.ptp(rows) + 1 >= 19 and np.ptp(cols) + 1 <= 5, (
        np.ptp(rows), np.ptp(cols))
  assert np.abs(digits[0].astype(int) - digits[1]).mean() < 8


def _write_images(folder: Path) -> tuple[Path, int]:
  """Grey and RGB, PNG and JPEG, different sizes, one corrupt file and a
  text file; returns the MNIST test image saved as PNG and its label."""
  images, labels = _mnist_test(3)
  folder.mkdir()
  png = folder / 'mnist_test_0.png'
  Image.fromarray(images[0, ..., 0]).save(png)
  # Black on white, in colour, stretched to 140x100.
  Image.fromarray(255 - images[1, ..., 0]).resize((140, 100)).convert(
      'RGB').save(folder / 'photo.jpg', quality=90)
  Image.fromarray(images[2, ..., 0]).resize((40, 40)).save(
      folder / 'small.jpeg')
  (folder / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\nnot an image')
  (folder / 'notes.txt').write_text('ignored')
  return png, int(labels[0])


@conftest.needs_mnist
def test_the_command_line_prints_a_line_per_readable_image(tmp_path, capsys):
  png, label = _write_images(tmp_path / 'images')
  # A tab in a file name is printed escaped: still three columns.
  shutil.copy(png, tmp_path / 'images' / 'tab\tname.png')
  status = pretrained.main(['capsnet_mnist_smoke', str(tmp_path / 'images')])
  out, err = capsys.readouterr()
  assert status == 0
  lines = [line.split('\t') for line in out.splitlines()]
  assert len(lines) == 4 and all(len(fields) == 3 for fields in lines)
  by_path = {fields[0]: fields for fields in lines}
  assert by_path[str(png)][1] == str(label)
  for path, name, score in lines:
    path = path.replace('\\t', '\t')
    assert Path(path).is_file() and name in [str(k) for k in range(10)]
    assert 0 <= float(score) <= 1
  assert 'broken.png' in err and 'broken.png' not in out


def test_the_command_line_exits_2_when_nothing_could_be_read(tmp_path,
                                                              capsys):
  (tmp_path / 'broken.png').write_bytes(b'not an image')
  status = pretrained.main(['capsnet_mnist_smoke', str(tmp_path),
                            str(tmp_path / 'missing.png')])
  out, err = capsys.readouterr()
  assert status == 2 and out == ''
  assert 'broken.png' in err and 'missing.png' in err


def readme_command() -> str:
  """The README's bash block after ``<!-- pretrained-command -->``."""
  text = open(os.path.join(REPO, 'README.md')).read()
  match = re.search(r'<!-- pretrained-command -->\n```bash\n(.*?)```', text,
                    re.S)
  assert match, 'README.md lacks the pretrained command block'
  return match.group(1)


@conftest.needs_mnist
def test_the_readme_command_classifies_a_folder(tmp_path):
  command = readme_command()
  assert '$IMAGES' in command and 'python -m capsjax.pretrained' in command
  png, label = _write_images(tmp_path / 'images')
  env = dict(conftest.training_env(), IMAGES=str(tmp_path / 'images'))
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
  result = subprocess.run(['bash', '-c', command], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert f'{png}\t{label}\t' in result.stdout
