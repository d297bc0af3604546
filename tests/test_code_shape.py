"""The library's shape: short functions, layers.py holding layers only,
and imports that go down the library's rooms, never up nor round.

A function's length is its lines, end to start, less its docstring's; a
long function is split into named steps instead. The routing math and the
pure helpers live in capsule_routing.py and nn.py, so layers.py stays the
parameter-holding modules.

The rooms, lowest first: the pieces (routing, layers, models, families,
losses, data, ...), ``evaluators``, ``training``, then ``pretrained``,
which uses trained models. A module imports from its own room and those
below it: the families name their trainer rather than import it, and the
evaluators are handed ``training.load_context`` rather than import it.
"""

import ast
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'capsjax'
MAX_FUNCTION_LINES = 80
MAX_LAYERS_LINES = 600


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """Lines of ``node``, its docstring's aside."""
  lines = node.end_lineno - node.lineno + 1
  first = node.body[0]
  if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)):
    lines -= first.end_lineno - first.lineno + 1
  return lines


def long_functions(max_lines: int) -> list[str]:
  """'path:line name (N lines)' for every function in capsjax/ over
  ``max_lines``."""
  found = []
  for path in sorted(PACKAGE.rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = function_lines(node)
        if lines > max_lines:
          found.append(f'{path.relative_to(PACKAGE.parent)}:{node.lineno} '
                       f'{node.name} ({lines} lines)')
  return found


def test_no_function_is_over_80_lines():
  too_long = long_functions(MAX_FUNCTION_LINES)
  assert not too_long, (
      f'functions over {MAX_FUNCTION_LINES} lines (docstrings aside); split '
      f'them into named steps: {too_long}')


def test_the_measure_counts_code_and_not_the_docstring():
  tree = ast.parse('def f():\n  """Doc\n  string."""\n  a = 1\n  return a\n')
  assert function_lines(tree.body[0]) == 3


def test_layers_stays_under_600_lines():
  lines = len((PACKAGE / 'layers.py').read_text().splitlines())
  assert lines <= MAX_LAYERS_LINES, (
      f'capsjax/layers.py has {lines} lines (at most {MAX_LAYERS_LINES}): '
      f'routing math belongs in capsule_routing.py, pure helpers in nn.py.')


# ----------------------------------------------------------------------------
# Imports: rooms and circles.

ROOMS = ('capsjax.evaluators', 'capsjax.training', 'capsjax.pretrained')


def module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(PACKAGE.parent).with_suffix('').parts)
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def room(module: str) -> int:
  """0 for the pieces, then the index in ROOMS plus 1."""
  for level, prefix in enumerate(ROOMS, 1):
    if module == prefix or module.startswith(prefix + '.'):
      return level
  return 0


def import_graph() -> dict[str, set[str]]:
  """Module of capsjax -> the modules of capsjax it imports, at its top or
  inside a function (``from capsjax import x`` counts as module x when x is
  one)."""
  modules = {module_name(p): p for p in PACKAGE.rglob('*.py')}

  def known(name):
    while name not in modules and '.' in name:
      name = name.rsplit('.', 1)[0]
    return name if name in modules else None

  graph = {}
  for name, path in modules.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found |= {known(a.name) for a in node.names}
      elif isinstance(node, ast.ImportFrom) and not node.level:
        found |= {known(f'{node.module}.{a.name}') for a in node.names}
    graph[name] = found - {None, name}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module."""
  index, low, stack, found = {}, {}, [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = stack[stack.index(v):]
      del stack[stack.index(v):]
      if len(component) > 1:
        found.append(sorted(component))

  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(limit, 10 * len(graph)))
  try:
    for v in graph:
      if v not in index:
        visit(v)
  finally:
    sys.setrecursionlimit(limit)
  return found


def test_no_module_imports_a_room_above_its_own():
  upward = sorted(f'{name} imports {target}'
                  for name, targets in import_graph().items()
                  for target in targets if room(target) > room(name))
  assert not upward, upward


def test_models_families_evaluators_and_training_import_in_no_circle():
  watched = ('capsjax.models', 'capsjax.families') + ROOMS[:2]
  circles = [c for c in cycles(import_graph())
             if any(m.startswith(watched) for m in c)]
  assert not circles, circles


def test_the_import_checks_see_an_upward_import_and_a_circle():
  graph = import_graph()
  assert 'capsjax.training.vector_capsules' in graph['capsjax.training.runs']
  assert 'capsjax.models' in graph['capsjax.families']
  planted = dict(graph, **{'capsjax.families': graph['capsjax.families'] | {
      'capsjax.training.vector_capsules'}})
  assert room('capsjax.training.vector_capsules') > room('capsjax.families')
  assert any({'capsjax.families', 'capsjax.training.vector_capsules'} <= set(c)
             for c in cycles(planted))
