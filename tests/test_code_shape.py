"""The library's shape: short functions, and capsjax.layers holding layers
only.

A function's length is its lines, end to start, less its docstring's; a
long function is split into named steps instead. The routing math and the
pure helpers live in capsjax.routing and nn.py, so each module of
capsjax.layers stays the parameter-holding modules of one kind of layer.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'capsjax'
MAX_FUNCTION_LINES = 80
MAX_LAYERS_MODULE_LINES = 400


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


def test_each_layers_module_stays_under_400_lines():
  for path in sorted((PACKAGE / 'layers').glob('*.py')):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LAYERS_MODULE_LINES, (
        f'{path.name} has {lines} lines (at most {MAX_LAYERS_MODULE_LINES}): '
        f'routing math belongs in capsjax.routing, pure helpers in nn.py.')
