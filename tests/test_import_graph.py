"""The package's import graph, read from the source (no import runs): no
circles between modules, and none between rooms (``capsjax``'s top-level
modules and packages), so that every room only imports rooms below it."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'capsjax'


def _modules() -> dict[str, pathlib.Path]:
  """'capsjax.a.b' -> its file, for every module of the package."""
  modules = {}
  for path in PACKAGE.rglob('*.py'):
    parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    modules['.'.join(parts)] = path
  return modules


def import_graph() -> dict[str, set[str]]:
  """Module -> the package's modules it imports anywhere in its file
  (function-level imports count: they are imports all the same)."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    package = name if path.name == '__init__.py' else name.rpartition('.')[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ''
        if node.level:
          base = '.'.join(package.split('.')[:len(package.split('.'))
                                             - node.level + 1]
                          + ([base] if base else []))
        # 'from a import b' names the module a.b where there is one, else a.
        targets = [f'{base}.{alias.name}' if f'{base}.{alias.name}' in modules
                   else base for alias in node.names]
      else:
        continue
      for target in targets:
        # The deepest module the import names ('capsjax.a.b.f' -> 'a.b').
        while target and target not in modules:
          target = target.rpartition('.')[0]
        # A module's own packages run before it whatever it imports.
        if target and not (name + '.').startswith(target + '.'):
          edges.add(target)
    graph[name] = edges
  return graph


def room(module: str) -> str:
  """'capsjax.training.loop' -> 'training'; 'capsjax' -> 'capsjax'."""
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every strongly connected component of more than one node (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in graph.get(node, ()):
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """Room -> the rooms its modules import (the top-level ``capsjax``
  module re-exports and is left out)."""
  rooms: dict[str, set[str]] = {}
  for module, targets in graph.items():
    if module == 'capsjax':
      continue
    rooms.setdefault(room(module), set()).update(
        room(t) for t in targets if t != 'capsjax' and room(t) != room(module))
  return rooms


def test_no_module_imports_itself_through_others():
  assert cycles(import_graph()) == []


def test_no_room_imports_a_room_above_it():
  assert cycles(room_graph(import_graph())) == []


def test_the_routing_math_imports_no_implementation():
  """What a routing computes does not depend on how it runs."""
  rooms = room_graph(import_graph())
  assert 'kernels' not in rooms['routing']
  assert rooms['routing'] <= set()  # only JAX and NumPy


def test_the_checks_find_a_planted_circle():
  graph = {'capsjax.a.x': {'capsjax.b.y'}, 'capsjax.b.y': {'capsjax.a.z'},
           'capsjax.a.z': set()}
  assert cycles(graph) == []
  assert cycles(room_graph(graph)) == [['a', 'b']]
  graph['capsjax.a.x'].add('capsjax.a.z')  # a shortcut: still no circle
  assert cycles(graph) == []
  graph['capsjax.a.z'] = {'capsjax.a.x'}
  assert cycles(graph) == [['capsjax.a.x', 'capsjax.a.z', 'capsjax.b.y']]
