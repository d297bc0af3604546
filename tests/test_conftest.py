"""The dataset gate of the suite: a skip here, a failure under CI."""

import pytest

from tests import conftest


class _Item:

  def __init__(self, directory):
    self._mark = pytest.mark.needs_data(str(directory)).mark

  def iter_markers(self, name):
    return [self._mark] if name == 'needs_data' else []


def test_missing_dataset_fails_under_ci_and_skips_elsewhere(tmp_path,
                                                            monkeypatch):
  item = _Item(tmp_path / 'mnist')
  monkeypatch.setenv('CI', 'true')
  with pytest.raises(pytest.fail.Exception, match='CI must have'):
    conftest.pytest_runtest_setup(item)
  monkeypatch.delenv('CI')
  with pytest.raises(pytest.skip.Exception, match='t10k-labels-idx1'):
    conftest.pytest_runtest_setup(item)


def test_present_dataset_runs(tmp_path, monkeypatch):
  monkeypatch.setenv('CI', 'true')
  for name in ('train-images-idx3', 'train-labels-idx1', 't10k-images-idx3',
               't10k-labels-idx1'):
    (tmp_path / f'{name}-ubyte.gz').write_bytes(b'')
  conftest.pytest_runtest_setup(_Item(tmp_path))  # neither skips nor fails
  (tmp_path / 't10k-labels-idx1-ubyte.gz').unlink()
  with pytest.raises(pytest.fail.Exception, match='t10k-labels-idx1'):
    conftest.pytest_runtest_setup(_Item(tmp_path))
