"""The public API imports: every name in capsjax.__all__, and the documented ones."""

import importlib

import pytest

import capsjax
from capsjax import kernels


def test_all_holds_unique_names():
  assert len(set(capsjax.__all__)) == len(capsjax.__all__)
  assert all(isinstance(name, str) for name in capsjax.__all__)


@pytest.mark.parametrize('name', capsjax.__all__)
def test_every_public_name_imports_and_is_callable(name):
  module = importlib.import_module('capsjax')
  assert hasattr(module, name), f'capsjax.{name} is in __all__ but missing'
  assert callable(getattr(module, name))


@pytest.mark.parametrize('name', ['squash', 'dynamic_routing', 'em_routing'])
def test_routing_names_exist_in_package_and_routing_module(name):
  """The routing math in capsjax.routing; at the top level the same, or for
  an operation with several implementations its choosing form
  (capsjax.kernels)."""
  routing = importlib.import_module('capsjax.routing')
  assert callable(getattr(routing, name))
  top = getattr(capsjax, name)
  assert top is getattr(routing, name) or (
      name in kernels.OPS and top is getattr(kernels, name))
  assert name in capsjax.__all__


def test_version():
  assert isinstance(capsjax.__version__, str) and capsjax.__version__
