"""capsjax.kernels.implementations: the one keyword's values, the choice
among an operation's implementations, and its record."""

import functools

import pytest

from capsjax.kernels import implementations


def _why_not(**reasons):
  """Why-not functions that give ``reasons`` ('' where none is given)."""
  return {name: functools.partial(reasons.get, name, '')
          for name in ('native', 'pallas')}


def test_every_operation_offers_xla_and_names_only_known_implementations():
  for op, names in implementations.OPS.items():
    assert 'xla' in names and set(names) <= set(implementations.NAMES), op
    assert implementations.DEFAULT_ORDER[op][-1] == 'xla', op
    assert set(implementations.DEFAULT_ORDER[op]) <= set(names), op


def test_check_names_the_operation_and_its_implementations():
  implementations.check(None, 'conv2d')
  implementations.check('native', 'conv2d')
  with pytest.raises(ValueError, match=r"conv2d's implementations "
                     r"\('xla', 'native'\), got 'pallas'"):
    implementations.check('pallas', 'conv2d')
  with pytest.raises(ValueError, match="capsjax's implementations"):
    implementations.check('cuda')


def test_for_op_passes_a_name_only_to_operations_that_have_it():
  assert implementations.for_op('pallas', 'dynamic_routing') == 'pallas'
  assert implementations.for_op('pallas', 'conv2d') is None
  assert implementations.for_op(None, 'conv2d') is None


def test_the_default_takes_the_first_that_can_and_records_why_not(monkeypatch):
  monkeypatch.delenv(implementations.ENVIRONMENT_VARIABLE, raising=False)
  op = 'conv_capsule_routing'
  with implementations.recording() as choices:
    assert implementations.choose(op, None, _why_not()) == 'native'
    assert implementations.choose(
        op, None, _why_not(native='no compiler')) == 'xla'
    assert implementations.choose(op, 'pallas', _why_not()) == 'pallas'
  assert implementations.describe(choices) == {
      op: 'native (1 call), pallas (1 call; named), '
          'xla (1 call; not native: no compiler)'}
  # Outside a recording nothing is counted.
  assert implementations.choose(op, None, _why_not()) == 'native'
  assert sum(choices.values()) == 3


def test_a_named_implementation_that_cannot_take_the_case_says_why():
  with pytest.raises(ValueError, match="conv_capsule_routing: implementation="
                     "'native' cannot take this case: no compiler. Use "
                     "implementation=None or 'xla'."):
    implementations.choose('conv_capsule_routing', 'native',
                           _why_not(native='no compiler'))


def test_the_environment_forces_xla_for_defaults_only(monkeypatch):
  monkeypatch.setenv(implementations.ENVIRONMENT_VARIABLE, 'xla')
  with implementations.recording() as choices:
    assert implementations.choose('conv2d', None, _why_not()) == 'xla'
    assert implementations.choose('conv2d', 'native', _why_not()) == 'native'
  assert implementations.describe(choices) == {
      'conv2d': 'native (1 call; named), '
                'xla (1 call; CAPSJAX_IMPLEMENTATION=xla)'}
  monkeypatch.setenv(implementations.ENVIRONMENT_VARIABLE, 'native')
  with pytest.raises(ValueError, match='must be unset or "xla"'):
    implementations.choose('conv2d', None, _why_not())


@pytest.mark.parametrize('stored,implementation', [
    ({'routing_impl': None, 'conv_impl': None}, None),
    ({'routing_impl': 'kernel'}, 'native'),
    ({'routing_impl': 'pallas', 'conv_impl': None}, 'pallas'),
    ({'conv_impl': 'onednn_input_grad'}, 'native'),
])
def test_workdirs_of_earlier_capsjax_read_as_implementation(stored,
                                                            implementation):
  """Their configs name the implementation routing_impl / conv_impl (and
  the fused kernel 'kernel'): the model gets ``implementation``."""
  import ml_collections

  from capsjax.training import state
  config = ml_collections.ConfigDict(
      {'model_options': {'num_iterations': 3, **stored}})
  options = state.model_options(config)
  assert 'routing_impl' not in options and 'conv_impl' not in options
  assert options.get('implementation') == implementation
  assert options['num_iterations'] == 3
