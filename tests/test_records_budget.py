"""The project's records stay within their budgets, and their links resolve.

``results/`` holds the evidence behind the numbers of README.md and
BENCHMARKS.md (one folder per claim), not every run ever made: superseded
runs and per-step dumps live in git history. README.md is a newcomer's
page and BENCHMARKS.md the current figures; the rest is in docs/.
"""

import glob
import os
import re
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RESULTS_MAX_FILES = 150
BENCHMARKS_MAX_LINES = 400
README_MAX_LINES = 200
# results/ and BENCHMARKS.md stay at least this far under their budgets
# (percent), so that a new record or section has room without pruning first.
MARGIN_PERCENT = 20


def _results_files():
  """The files of results/: git-tracked ones in a checkout, else all."""
  results = os.path.join(REPO, 'results')
  if shutil.which('git') and os.path.isdir(os.path.join(REPO, '.git')):
    out = subprocess.run(['git', 'ls-files', '-z', '--', 'results'],
                         cwd=REPO, capture_output=True, check=False)
    if out.returncode == 0:
      return [p for p in out.stdout.decode().split('\0') if p]
  return [os.path.join(dirpath, name)
          for dirpath, _, names in os.walk(results) for name in names]


def _lines(name):
  with open(os.path.join(REPO, name), encoding='utf-8') as f:
    return len(f.read().splitlines())


def test_results_holds_at_most_its_budget_of_files():
  count = len(_results_files())
  assert count <= RESULTS_MAX_FILES, (
      f'results/ holds {count} tracked files, over its budget of '
      f'{RESULTS_MAX_FILES}: leave superseded runs, trial scripts and logs '
      'no page cites to git history (results/README.md says how)')


@pytest.mark.parametrize('what, count, budget', [
    ('results/ (tracked files)', lambda: len(_results_files()),
     RESULTS_MAX_FILES),
    ('BENCHMARKS.md (lines)', lambda: _lines('BENCHMARKS.md'),
     BENCHMARKS_MAX_LINES),
], ids=['results', 'BENCHMARKS.md'])
def test_records_stay_a_margin_under_their_budget(what, count, budget):
  """results/ and BENCHMARKS.md keep 20% of their budgets free (at most
  120 files, 320 lines): growth is pruned as it comes, not at the limit."""
  limit = budget * (100 - MARGIN_PERCENT) // 100
  held = count()
  assert held <= limit, (
      f'{what}: {held}, over {limit}, {MARGIN_PERCENT}% under the budget '
      f'of {budget}: leave superseded runs and history to git history (the '
      'record\'s README names the commit that holds them)')


def test_every_record_folder_is_in_the_index():
  """results/README.md names every claim's folder (results/X/ and
  results/benchmarks/X/), so no record is out of the index."""
  results = os.path.join(REPO, 'results')
  claims = set()
  for path in _results_files():
    # (git's paths are relative to the checkout; os.walk's are absolute)
    parts = os.path.relpath(os.path.join(REPO, path), results).split(os.sep)
    depth = 2 if parts[0] == 'benchmarks' else 1
    if len(parts) > depth:
      claims.add('/'.join(parts[:depth]))
  with open(os.path.join(REPO, 'results', 'README.md'), encoding='utf-8') as f:
    index = f.read()
  missing = sorted(c for c in claims if f'`{c}/`' not in index)
  assert not missing, (f'results/README.md does not index {missing}: add a '
                       'row naming each folder, its claim and device')


@pytest.mark.parametrize('name, budget', [
    ('BENCHMARKS.md', BENCHMARKS_MAX_LINES),
    ('README.md', README_MAX_LINES),
])
def test_page_is_within_its_line_budget(name, budget):
  count = _lines(name)
  assert count <= budget, (
      f'{name} has {count} lines, over its budget of {budget}: move detail '
      'into docs/ and link it')


_LINK = re.compile(r'\]\(([^)\s]+)\)')


def _pages():
  pages = ['README.md', 'BENCHMARKS.md']
  pages += sorted(os.path.relpath(p, REPO)
                  for p in glob.glob(os.path.join(REPO, 'docs', '*.md')))
  return pages


def _relative_links(text):
  for target in _LINK.findall(text):
    if re.match(r'^[a-z][a-z0-9+.-]*:', target, re.I) or target.startswith(
        ('#', '/')):
      continue  # a URL, mailto:, an anchor or an absolute path
    yield target.split('#', 1)[0]


@pytest.mark.parametrize('page', _pages())
def test_every_relative_link_points_to_an_existing_file(page):
  with open(os.path.join(REPO, page), encoding='utf-8') as f:
    text = f.read()
  base = os.path.dirname(os.path.join(REPO, page))
  missing = [target for target in _relative_links(text)
             if target and not os.path.exists(os.path.join(base, target))]
  assert not missing, f'{page} links to missing paths: {missing}'


def test_the_link_check_sees_links():
  text = ('[a](docs/x.md) [b](https://example.org) [c](#top) '
          '[d](results/y/README.md#claim)')
  assert list(_relative_links(text)) == ['docs/x.md', 'results/y/README.md']


def _runs_rows():
  """The finished per-run rows of docs/paper_suite_results.md's block: (title,
  test cell), the seeds' mean rows left out."""
  with open(os.path.join(REPO, 'docs', 'paper_suite_results.md'),
            encoding='utf-8') as f:
    text = f.read()
  block = text[text.index('<!-- reproduction:begin -->'):
               text.index('<!-- reproduction:end -->')]
  rows = []
  for line in block.splitlines()[3:]:
    cells = [cell.strip() for cell in line.strip().strip('|').split('|')]
    if cells[-1] == 'finished' and not re.search(r', mean of \d+ seeds$',
                                                 cells[0]):
      rows.append((cells[0], cells[3]))
  return rows


def test_every_full_run_is_reported_in_the_readme_results():
  """A run that docs/paper_suite_results.md says finished has its test number, in
  bold as the full runs' numbers are, in the README's Results section: a
  new result is reported, and a number there that no run gave is caught
  when it replaces the run's own."""
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    readme = f.read()
  results = readme[readme.index('## Results'):]
  results = results[:results.index('\n## ', 1)]
  rows = _runs_rows()
  assert rows, 'docs/paper_suite_results.md lists no finished run'
  missing = [(title, test) for title, test in rows
             if f'**{test}**' not in results]
  assert not missing, ('README.md\'s Results do not report these finished '
                       f'runs of docs/paper_suite_results.md: {missing}')


def test_every_test_docs_guarantees_cites_exists():
  """docs/guarantees.md backs each guarantee with tests by name
  (`tests/test_x.py::test_y`, then `::test_z` in the same file): each is a
  test function of that file, so a renamed or deleted test cannot leave a
  guarantee citing nothing."""
  with open(os.path.join(REPO, 'docs', 'guarantees.md'),
            encoding='utf-8') as f:
    text = f.read()
  cited, missing, current = 0, [], None
  for token in re.findall(r'`([^`]+)`', text):
    match = re.fullmatch(r'(tests/\w+\.py)?(?:::(\w+)(\*)?(?:\[.*\])?)?', token)
    if not match or not any(match.groups()[:2]):
      continue
    path, name, wildcard = match.groups()
    current = path or current
    if name is None:
      continue  # a file named alone: the names that follow are its
    assert current, f'::{name} cites no file before it'
    with open(os.path.join(REPO, current), encoding='utf-8') as f:
      pattern = rf'^def {name}' + (r'\w*\(' if wildcard else r'\(')
      if not re.search(pattern, f.read(), re.M):
        missing.append(f'{current}::{name}{wildcard or ""}')
    cited += 1
  assert cited > 20, cited
  assert not missing, f'docs/guarantees.md cites missing tests: {missing}'


# The suite's time budgets on the 2-core AMD EPYC, idle, clean clone, cold
# (seconds): what a contributor runs after each change, and what CI runs.
UNIT_TIER_BUDGET_S = 300
CI_BUDGET_S = 600


def test_the_recorded_clean_clone_ci_run_is_a_margin_under_the_budgets():
  """results/ci's cold clean-clone run, which its README cites: it passed,
  its unit tier took at most 90% of 300 s and the whole of CI at most 90%
  of 600 s, and the README quotes those numbers (a slower suite shows when
  the record is refreshed, not at the budget's edge)."""
  with open(os.path.join(REPO, 'results', 'ci', 'clean_clone_ci_amd.log'),
            encoding='utf-8') as f:
    log = f.read()
  assert re.search(r'^exit 0$', log, re.M), 'the recorded CI run failed'
  unit = float(re.search(r'\[unit\] exit status 0 in ([\d.]+) s', log)[1])
  total = int(re.search(r'^CI finished in (\d+) s$', log, re.M)[1])
  assert unit <= 0.9 * UNIT_TIER_BUDGET_S, unit
  assert total <= 0.9 * CI_BUDGET_S, total
  with open(os.path.join(REPO, 'results', 'ci', 'README.md'),
            encoding='utf-8') as f:
    readme = f.read()
  assert f'**{unit:.1f} s**' in readme and f'**{total} s**' in readme
