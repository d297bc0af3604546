"""Sphinx configuration of capsjax's documentation: the pages of docs/ as
chapters, the API reference from the docstrings (docs/api/), and the
notebook with its stored outputs (not executed).

Built offline, warnings as errors (README.md, "Documentation"):

    python -m sphinx -W --keep-going -n -b html docs docs/_build/html
"""

import functools
import os
import pkgutil
import re
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)
sys.path.insert(0, REPO)  # this checkout's capsjax, installed or not

project = 'capsjax'
author = 'the capsjax authors'
copyright = 'the capsjax authors; Apache-2.0'  # noqa: A001

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'myst_nb',  # MyST markdown (myst-parser) and notebooks
]
source_suffix = {'.md': 'myst-nb', '.ipynb': 'myst-nb'}
root_doc = 'index'
exclude_patterns = ['_build', 'notebooks/.ipynb_checkpoints']
html_theme = 'alabaster'
html_title = 'capsjax'

# The notebook is rendered with the outputs it is committed with
# (tests/test_notebook.py executes it).
nb_execution_mode = 'off'
myst_heading_anchors = 3
myst_enable_extensions = ['dollarmath']

# A package's page documents what the package itself defines; the names it
# imports from its modules are documented on those modules' pages.
autodoc_default_options = {'members': True, 'member-order': 'bysource',
                           'ignore-module-all': True}
autodoc_typehints = 'signature'
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# A return value's "type" in these docstrings is prose (names of tuple
# parts), not a class to link to.
napoleon_use_rtype = False
# "Attributes:" as fields of the class: autodoc documents a NamedTuple's
# fields as members already.
napoleon_use_ivar = True

# Modules whose docstrings are written as plain text for help() (ASCII
# formulas such as |s|^2, indented pseudo-code, "Returns: (a, b)" prose),
# not as reStructuredText, are marked on their page of docs/api/ by the
# comment line PLAIN_TEXT_MARK right after their automodule directive:
# their docstrings are shown preformatted, exactly as written, instead of
# being parsed. Every other module's docstrings are parsed (Google style,
# napoleon) and must be valid reStructuredText with resolvable references:
# the strict build fails otherwise. A module loses its mark once its
# docstrings are valid reStructuredText.
PLAIN_TEXT_MARK = '.. docstrings as plain text'

# No intersphinx (the build is offline): references to other libraries'
# types in signatures cannot resolve, and nitpicky mode ignores those only.
nitpicky = True
_OTHER_LIBRARIES = (
    'jax', 'jnp', 'jaxlib', 'flax', 'nnx', 'np', 'numpy', 'optax', 'orbax',
    'ocp', 'ml_collections', 'PIL', 'matplotlib', 'plt', 'scipy', 'chex',
    'tensorboardX', 'collections', 'typing', 'typing_extensions', 'pathlib',
    'types', 'concurrent', 'ctypes', 'argparse', 'threading', 'io', 'os',
    'subprocess', 'logging', 'enum', 'dataclasses', 'functools', 'abc',
    'Path')
nitpick_ignore_regex = [
    (r'py:.*', rf'({"|".join(_OTHER_LIBRARIES)})(\..*)?'),
    # Type variables (``T = TypeVar('T')``) in signatures.
    (r'py:class', r'capsjax(\.\w+)*\.[A-Z]'),
    # Builtins and typing names as autodoc writes them.
    (r'py:.*', r'(int|float|str|bool|bytes|dict|list|tuple|set|object|'
     r'type|None|Any|Callable|Sequence|Iterable|Iterator|Mapping|'
     r'NamedTuple|Literal|Optional|Union|TypeVar|Self|Ellipsis|'
     r'Exception|RuntimeError|ValueError|KeyboardInterrupt)'),
]

# The documented modules are those that docs/api/*.md name in an
# ``automodule`` directive; every public module of the package must be one
# of them (a new or moved module without its page fails the build).
_AUTOMODULE = re.compile(r'^\.\. automodule:: (\S+)\n(.*)$', re.M)


@functools.cache
def _api_pages() -> dict[str, bool]:
  """{module: whether its docstrings are plain text} of docs/api/*.md."""
  modules = {}
  api = os.path.join(DOCS, 'api')
  for page in sorted(os.listdir(api)):
    if page.endswith('.md'):
      with open(os.path.join(api, page)) as f:
        for name, after in _AUTOMODULE.findall(f.read()):
          modules[name] = after.strip() == PLAIN_TEXT_MARK
  return modules


def documented_modules() -> set[str]:
  return set(_api_pages())


def plain_text_modules() -> set[str]:
  return {name for name, plain in _api_pages().items() if plain}


@functools.cache
def public_modules() -> frozenset[str]:
  import capsjax
  names = {'capsjax'}
  for module in pkgutil.walk_packages(capsjax.__path__, 'capsjax.'):
    if not any(part.startswith('_') for part in module.name.split('.')):
      names.add(module.name)
  return frozenset(names)


def _check_every_module_documented(app, config):
  from sphinx.util import logging
  logger = logging.getLogger('capsjax.docs')
  documented = documented_modules()
  for name in sorted(public_modules() - documented):
    logger.warning(f'module {name} is on no page of docs/api/ (add an '
                   f'automodule directive for it)')
  for name in sorted(documented - public_modules()):
    logger.warning(f'docs/api/ documents {name}, which is no module of '
                   f'capsjax')
  # The names ``import capsjax`` exports: each in the table of package.md.
  import capsjax
  with open(os.path.join(DOCS, 'api', 'package.md')) as f:
    listed = set(re.findall(r'^\| `capsjax\.(\w+)`', f.read(), re.M))
  for name in sorted(set(capsjax.__all__) - listed):
    logger.warning(f'capsjax.{name} is missing from the table of '
                   f'docs/api/package.md')


# Links from a page to a file of the repository outside docs/ (README.md,
# results/*/README.md, BENCHMARKS.md): MyST would look for a page of the
# site. They become links to the file in the clone, relative to the built
# page; a file that does not exist is left to MyST, which reports it (an
# error in the strict build).
def _link_to_repository_files(app, doctree):
  from docutils import nodes
  from sphinx import addnodes
  docname = app.env.docname
  source_dir = os.path.dirname(app.env.doc2path(docname))
  page_dir = os.path.dirname(os.path.join(app.outdir, docname))
  for node in list(doctree.findall(addnodes.pending_xref)):
    if node.get('reftype') != 'myst':
      continue
    if node.get('refdomain') == 'doc':  # a link to a .md: MyST's docname
      target = os.path.join(app.srcdir, node['reftarget']) + '.md'
      anchor = node.get('reftargetid') or ''
    else:  # a link to another file, relative to the page
      target, _, anchor = node.get('reftarget', '').partition('#')
      if not target or '://' in target:
        continue
      target = os.path.join(source_dir, target)
    path = os.path.normpath(target)
    if path.startswith(DOCS + os.sep) or not os.path.exists(path):
      continue
    uri = os.path.relpath(path, page_dir) + (f'#{anchor}' if anchor else '')
    reference = nodes.reference('', '', internal=False, refuri=uri)
    reference.extend(node.children)
    node.replace_self(reference)


def _module_of(name: str, obj) -> str:
  module = getattr(obj, '__module__', None)
  if isinstance(module, str) and module.startswith('capsjax'):
    return module
  if type(obj).__name__ == 'module':
    return obj.__name__
  parts = name.split('.')
  while parts and '.'.join(parts) not in public_modules():
    parts.pop()
  return '.'.join(parts)


def _plain_text_docstring(app, what, name, obj, options, lines):
  """The docstring preformatted, for the modules marked
  PLAIN_TEXT_MARK."""
  if _module_of(name, obj) not in plain_text_modules() or not lines:
    return
  import inspect
  text = inspect.getdoc(obj) if what != 'attribute' else '\n'.join(lines)
  if not text:
    return
  lines[:] = ['::', ''] + ['   ' + line for line in text.splitlines()] + ['']


def _init_signature(app, what, name, obj, options, signature,
                    return_annotation):
  """A Flax NNX module's constructor arguments: NNX's metaclass shows
  ``(*args, **kwargs)`` to autodoc."""
  if what != 'class' or signature != '(*args: Any, **kwargs: Any)':
    return None
  from sphinx.util import inspect as sphinx_inspect
  init = sphinx_inspect.signature(
      obj.__init__, bound_method=True,
      type_aliases=app.config.autodoc_type_aliases)
  return sphinx_inspect.stringify_signature(
      init, show_return_annotation=False), return_annotation


def setup(app):
  app.connect('autodoc-process-signature', _init_signature)
  # After napoleon (priority 500): the original docstring replaces its
  # output.
  app.connect('autodoc-process-docstring', _plain_text_docstring,
              priority=600)
  app.connect('config-inited', _check_every_module_documented)
  app.connect('doctree-read', _link_to_repository_files)
