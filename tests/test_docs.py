"""The documentation builds strictly: the pages of docs/, the API reference
from the docstrings and the notebook, with every warning an error
(``-W --keep-going``), nitpicky cross-references, and a public module or
exported name missing from docs/api/ failing the build (docs/conf.py).

Needs the ``docs`` extra (sphinx, myst-parser, myst-nb); skipped without
it, except under CI (CI=true), where it must run.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# The command README.md gives, with the output in a scratch folder.
BUILD = (sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-n', '-q',
         '-b', 'html')


def _needs_sphinx():
  missing = [name for name in ('sphinx', 'myst_parser', 'myst_nb')
             if importlib.util.find_spec(name) is None]
  if missing:
    message = (f'{", ".join(missing)} not installed: pip install -e '
               f'\'.[docs]\'')
    if os.environ.get('CI') == 'true':
      pytest.fail(f'{message}; CI must build the documentation.',
                  pytrace=False)
    pytest.skip(message)


def test_the_documentation_builds_with_warnings_as_errors(tmp_path):
  _needs_sphinx()
  out = tmp_path / 'html'
  result = subprocess.run(
      [*BUILD, '-d', str(tmp_path / 'doctrees'), 'docs', str(out)],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
  assert (out / 'index.html').is_file()
  # The chapters, the API pages and the notebook with its stored plots.
  for page in ('library', 'own_images', 'routings', 'experiments',
               'authors_code', 'speed', 'multi_host', 'api/routing',
               'api/layers', 'api/models', 'api/losses', 'api/data',
               'api/training', 'api/pretrained', 'api/evaluators',
               'api/flops', 'api/kernels', 'own_model',
               'paper_suite_results'):
    assert (out / f'{page}.html').is_file(), page
  routing = (out / 'api' / 'routing.html').read_text()
  assert 'id="capsjax.routing.dynamic.dynamic_routing"' in routing
  assert 'id="capsjax.routing.em.em_routing"' in routing
  kernels = (out / 'api' / 'kernels.html').read_text()
  assert 'id="capsjax.kernels.ops.dynamic_routing"' in kernels
  notebook = (out / 'notebooks' / 'routing_as_clustering.html').read_text()
  assert notebook.count('<img') >= 3


@pytest.mark.slow
def test_a_broken_reference_fails_the_build(tmp_path):
  """The strictness is real: a page naming a function that does not exist
  fails the same build (the slow tier: it checks the build command, which
  changes rarely; the build itself runs in the unit tier)."""
  _needs_sphinx()
  docs = tmp_path / 'docs'
  docs.mkdir()
  for name in ('conf.py',):
    (docs / name).write_text((open(os.path.join(REPO, 'docs', name))).read()
                             .replace("DOCS = os.path.dirname(os.path.abspath("
                                      "__file__))",
                                      f"DOCS = {os.path.join(REPO, 'docs')!r}"))
  (docs / 'index.md').write_text(
      '# x\n\n{py:func}`capsjax.routing.no_such_routing`\n')
  result = subprocess.run(
      [*BUILD, '-d', str(tmp_path / 'doctrees'), str(docs),
       str(tmp_path / 'html')], cwd=REPO, capture_output=True, text=True,
      timeout=600)
  assert result.returncode != 0
  assert 'capsjax.routing.no_such_routing' in result.stderr, result.stderr
