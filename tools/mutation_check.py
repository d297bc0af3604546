"""Plant known bugs in a scratch copy of the repository; the tests must fail.

    python tools/mutation_check.py               # every mutation
    python tools/mutation_check.py --only=skip_e_step,swap_softmax_axis
    python tools/mutation_check.py --list
    python tools/mutation_check.py --ci --no-control --jobs=2   # what CI runs

Each mutation replaces one exact piece of source (it must occur exactly once)
in a fresh copy of the working tree, then runs the tests that should catch
it, with the copy first on the path. A mutation is "caught" when a test
fails (pytest exit status 1 with a FAILED test; a collection error or a
crash is an error, not a catch: a run killed by a signal prints pytest's
faulthandler stacks and runs once more, and its row names the crash); the
table at the end names the failing tests. First the same tests run on an
unmutated copy and must pass (else a failure would prove nothing);
``--no-control`` skips that run where those tests have just passed on the
same tree (CI runs the whole suite first).
``--jobs=N`` checks N mutations at a time (each is one pytest process,
mostly compiling on one core). ``--ci`` is the subset CI runs: one
mutation for each of the losses, the data pipeline, each family's train
step, resume, the EM and the attention routing and the batch
normalisation. Exit status 1 if the control failed or any mutation
survived or errored. Nothing in the working tree is modified.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutation:
  name: str
  path: str
  old: str
  new: str
  tests: tuple[str, ...]  # pytest node ids or files, relative to the repo


MUTATIONS = (
    Mutation(
        'drop_evaluation_mask', 'capsjax/training/evaluation.py',
        '    mask = idx < num',
        '    mask = idx >= 0  # the padded copies counted too',
        ('tests/test_evaluators.py',)),
    Mutation(
        'select_last_not_best', 'capsjax/training/loop.py',
        '    self.state = restored.state\n\n  def eval_context',
        '    del restored  # the last weights tested\n\n  def eval_context',
        ('tests/test_evaluators.py',)),
    Mutation(
        'ignore_beta_a', 'capsjax/routing/em.py',
        '    activation_logits = inverse_temperature * (beta_a - cost)',
        '    activation_logits = inverse_temperature * (0.0 * beta_a - cost)',
        ('tests/test_routing.py',)),
    Mutation(
        'skip_e_step', 'capsjax/routing/em.py',
        '    log_assignments = em_e_step(votes32, poses, log_variances,\n'
        '                                activation_logits, assignment_normalizer)',
        '    log_assignments = state.log_assignments',
        ('tests/test_routing.py::test_em_routing_matches_reference',)),
    Mutation(
        'swap_softmax_axis', 'capsjax/routing/dynamic.py',
        '    return jax.nn.softmax(logits, axis=-1)',
        '    return jax.nn.softmax(logits, axis=-2)',
        ('tests/test_routing.py',)),
    Mutation(
        'average_not_sum_votes', 'capsjax/routing/dynamic.py',
        "  s = jnp.einsum('...io,...iod->...od', coupling, votes)",
        "  s = jnp.einsum('...io,...iod->...od', coupling, votes) / votes.shape[-3]",
        ('tests/test_routing.py',)),
    # The attention routings.
    Mutation(
        'self_attention_softmax_over_inputs', 'capsjax/routing/attention.py',
        '  coupling = jax.nn.softmax(agreement, axis=-1)\n'
        '  if log_priors is not None:',
        '  coupling = jax.nn.softmax(agreement, axis=-2)\n'
        '  if log_priors is not None:',
        ('tests/test_attention_routing.py',)),
    Mutation(
        'self_attention_unscaled', 'capsjax/routing/attention.py',
        "  agreement = _SUM('...iod,...od->...io', wide, total) / "
        'math.sqrt(dim)',
        "  agreement = _SUM('...iod,...od->...io', wide, total)",
        ('tests/test_attention_routing.py',)),
    Mutation(
        'self_attention_priors_in_the_logits', 'capsjax/routing/attention.py',
        '    coupling = coupling + jnp.broadcast_to(\n'
        '        jnp.asarray(log_priors, wide.dtype), coupling.shape)',
        '    coupling = jax.nn.softmax(agreement + jnp.broadcast_to(\n'
        '        jnp.asarray(log_priors, wide.dtype), coupling.shape), '
        'axis=-1)',
        ('tests/test_attention_routing.py',)),
    Mutation(
        'efficient_squash_is_the_capsnet_squash',
        'capsjax/routing/attention.py',
        '  return (-jnp.expm1(-norm) / norm * s_wide).astype(s.dtype)',
        '  return (norm / (1 + norm**2) * s_wide).astype(s.dtype)',
        ('tests/test_attention_routing.py',)),
    Mutation(
        'inverted_routing_skips_the_layer_norm',
        'capsjax/routing/attention.py',
        '    if not layer_norm or dim == 1:\n      return poses',
        '    if True:\n      return poses',
        ('tests/test_attention_routing.py',)),
    Mutation(
        'inverted_routing_softmax_over_inputs', 'capsjax/routing/attention.py',
        '    r = jax.nn.softmax(agreement, axis=-1)',
        '    r = jax.nn.softmax(agreement, axis=-2)',
        ('tests/test_attention_routing.py',)),
    Mutation(
        'inverted_routing_skips_the_middle_iterations',
        'capsjax/routing/attention.py',
        '      lambda _, poses: pose_update(routing_coefficients(poses)), '
        'poses,',
        '      lambda _, poses: poses, poses,',
        ('tests/test_attention_routing.py',)),
    Mutation(
        'layer_norm_unbiased_variance', 'capsjax/routing/attention.py',
        '  variance = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)',
        '  variance = jnp.sum(jnp.square(centred), axis=-1, keepdims=True) / '
        '(wide.shape[-1] - 1)',
        ('tests/test_attention_routing.py',)),
    # Efficient-CapsNet's model and augmentation.
    Mutation(
        'efficient_primary_capsules_strided', 'capsjax/layers/efficient.py',
        "    y = y.reshape(y.shape[0], -1, self.dim)  # [B, H'*W'*C/dim, dim]",
        '    y = y.reshape(y.shape[0], self.dim, -1).swapaxes(1, 2)',
        ('tests/test_efficient_capsnet.py::'
         'test_forward_matches_float64_reference_of_the_authors_graph',)),
    Mutation(
        'efficient_batch_norm_before_relu', 'capsjax/models.py',
        '      y = jax.nn.relu(conv(x))\n'
        '      # Its running averages stay float32 under a bfloat16 compute '
        'dtype.\n'
        '      x = norm(y, train=train).astype(y.dtype)',
        '      y = conv(x)\n'
        '      x = jax.nn.relu(norm(y, train=train).astype(y.dtype))',
        ('tests/test_efficient_capsnet.py::'
         'test_forward_matches_float64_reference_of_the_authors_graph',)),
    Mutation(
        'batch_norm_biased_running_variance', 'capsjax/nn.py',
        '    bessel = count / max(count - 1, 1)',
        '    bessel = 1.0',
        ('tests/test_efficient_capsnet.py::'
         'test_forward_matches_float64_reference_of_the_authors_graph',)),
    Mutation(
        'batch_norm_momentum_the_wrong_way', 'capsjax/nn.py',
        '        momentum * mean + (1 - momentum) * batch_mean)',
        '        (1 - momentum) * mean + momentum * batch_mean)',
        ('tests/test_efficient_capsnet.py::'
         'test_forward_matches_float64_reference_of_the_authors_graph',)),
    Mutation(
        'efficient_rotation_the_wrong_way', 'capsjax/data/augment.py',
        '    alpha, beta = np.cos(np.deg2rad(degrees)), '
        'np.sin(np.deg2rad(degrees))',
        '    alpha, beta = np.cos(np.deg2rad(degrees)), '
        '-np.sin(np.deg2rad(degrees))',
        ('tests/test_efficient_capsnet.py::'
         'test_augmentation_steps_match_references',)),
    Mutation(
        'efficient_shift_short_of_the_far_margin', 'capsjax/data/augment.py',
        '    forth = jnp.floor(a * (1 + after).astype(jnp.float32))',
        '    forth = jnp.floor(a * after.astype(jnp.float32))',
        ('tests/test_efficient_capsnet.py::'
         'test_augmentation_steps_match_references',)),
    Mutation(
        'efficient_squeeze_one_column_short', 'capsjax/data/augment.py',
        '  removed = jnp.floor(amounts[:, 0] * (w / 4) + 1).astype(jnp.int32)',
        '  removed = jnp.floor(amounts[:, 0] * (w / 4)).astype(jnp.int32)',
        ('tests/test_efficient_capsnet.py::'
         'test_augmentation_steps_match_references',)),
    # The fused EM kernel's hand-derived backward pass.
    Mutation(
        'em_kernel_drops_the_variance_gradient', 'capsjax/kernels/csrc/em_routing.cc',
        '      g_s[k] += g_q[o] * diff * diff;',
        '      g_s[k] += T(0);',
        ('tests/test_em_kernel.py::'
         'test_kernel_gradients_equal_autodiff_of_em_routing',)),
    Mutation(
        'em_kernel_drops_the_momentum_gradient', 'capsjax/kernels/csrc/em_routing.cc',
        '        g_mu_prev[k] = c * g_mu[k];',
        '        g_mu_prev[k] = T(0);',
        ('tests/test_em_kernel.py::'
         'test_kernel_gradients_equal_autodiff_of_em_routing',)),
    # The losses.
    Mutation(
        'official_margin_not_halved', 'capsjax/losses.py',
        '    return 0.5 * jnp.mean(present + absent, axis=-1)',
        '    return jnp.mean(present + absent, axis=-1)',
        ('tests/test_official_capsnet.py::'
         'test_official_margin_loss_is_the_text_one_over_twice_the_classes',)),
    Mutation(
        'spread_loss_counts_the_target', 'capsjax/losses.py',
        '  total = jnp.sum(gaps * (1.0 - one_hot), axis=-1)',
        '  total = jnp.sum(gaps, axis=-1)',
        ('tests/test_training_matrix_capsules.py::'
         'test_em_loss_branches_equal_their_definitions',)),
    # The data pipeline.
    Mutation(
        'shift_the_wrong_way', 'capsjax/data/augment.py',
        '    return jax.lax.dynamic_slice(image, (m - offset[0], m - offset[1], 0),',
        '    return jax.lax.dynamic_slice(image, (m + offset[0], m + offset[1], 0),',
        ('tests/test_data_augment.py',)),
    # Each family's train step.
    Mutation(
        'dynamic_step_drops_reconstruction', 'capsjax/families.py',
        '                                                  images)\n'
        "      metrics['reconstruction_loss'] = jnp.mean(reconstruction)\n"
        '      loss = loss + config.reconstruction_weight * reconstruction',
        '                                                  images)\n'
        "      metrics['reconstruction_loss'] = jnp.mean(reconstruction)\n"
        '      loss = loss + 0.0 * reconstruction',
        ('tests/test_official_capsnet.py::'
         'test_official_capsnet_matches_the_official_code',)),
    Mutation(
        'em_step_margin_ignores_the_step', 'capsjax/training/matrix_capsules.py',
        '                                  step=state.step)[0])',
        '                                  step=0)[0])',
        ('tests/test_training_matrix_capsules.py::'
         'test_train_step_feeds_the_state_step_to_the_loss',)),
    Mutation(
        'two_digit_loss_weights_negatives_fully', 'capsjax/families.py',
        '                              negative_weight=0.25)',
        '                              negative_weight=1.0)',
        ('tests/test_adversarial.py::test_attack_losses',)),
    Mutation(
        'cnn_multi_label_loss_averaged', 'capsjax/families.py',
        '    return jnp.sum(optax.sigmoid_binary_cross_entropy(scores, targets),',
        '    return jnp.mean(optax.sigmoid_binary_cross_entropy(scores, targets),',
        ('tests/test_multimnist_train.py::'
         'test_baseline_sigmoid_loss_matches_numpy',)),
    # Resume.
    Mutation(
        'resume_from_scratch', 'capsjax/training/loop.py',
        '    self.resumed = self.checkpoints.restore_newest_good(self.state, '
        'self.say)',
        '    self.resumed = None',
        ('tests/test_workdir_integrity.py::test_damaged_latest_checkpoint_is_'
         'said_and_the_run_resumes_from_the_good_one',)),
)

# What CI runs after the suite: a mutation for each of the losses, the data
# pipeline, each family's train step, resume, the EM and the attention
# routing and the batch normalisation, each caught by one or two tests that
# run in seconds.
CI_SUBSET = (
    'official_margin_not_halved',
    'spread_loss_counts_the_target',
    'shift_the_wrong_way',
    'dynamic_step_drops_reconstruction',
    'em_step_margin_ignores_the_step',
    'two_digit_loss_weights_negatives_fully',
    'resume_from_scratch',
    'skip_e_step',
    'self_attention_softmax_over_inputs',
    'batch_norm_biased_running_variance',
)


def copy_tree(destination: str) -> None:
  """The working tree's tracked and untracked-but-not-ignored files."""
  files = subprocess.run(
      ['git', 'ls-files', '-co', '--exclude-standard', '-z'], cwd=REPO,
      check=True, capture_output=True).stdout.decode().split('\0')
  for name in filter(None, files):
    source = os.path.join(REPO, name)
    if not os.path.isfile(source):
      continue
    target = os.path.join(destination, name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy2(source, target)
  shared = os.path.join(os.path.dirname(REPO), 'shared')
  if os.path.isdir(shared):  # ../shared/data for the tests that read MNIST
    os.symlink(shared, os.path.join(os.path.dirname(destination), 'shared'))


def apply(mutation: Mutation, root: str) -> None:
  path = os.path.join(root, mutation.path)
  text = open(path).read()
  count = text.count(mutation.old)
  if count != 1:
    raise SystemExit(f'mutation {mutation.name}: the text to replace occurs '
                     f'{count} times in {mutation.path} (expected once); '
                     f'update tools/mutation_check.py.')
  with open(path, 'w') as f:
    f.write(text.replace(mutation.old, mutation.new))


def run_tests(mutation: Mutation, root: str) -> tuple[str, list[str], float]:
  """('passed', 'failed' or 'error: ...', failing test ids, seconds)."""
  env = dict(os.environ, PYTHONPATH=root, CAPSJAX_RETAIN_HOST_MEMORY='0')
  start = time.time()
  out = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider',
       '-m', 'not slow', *mutation.tests],
      cwd=root, env=env, capture_output=True, text=True)
  failed = re.findall(r'^FAILED (\S+)', out.stdout, re.M)
  # The copy must be what was imported, or the check proves nothing.
  probe = subprocess.run(
      [sys.executable, '-c', 'import capsjax, os; print(os.path.abspath('
       'capsjax.__file__))'], cwd=root, env=env, capture_output=True,
      text=True).stdout.strip()
  if not probe.startswith(os.path.realpath(root)) and not probe.startswith(
      root):
    raise SystemExit(f'capsjax was imported from {probe}, not the scratch '
                     f'copy {root}.')
  seconds = time.time() - start
  if out.returncode == 0:
    return 'passed', failed, seconds
  if out.returncode == 1 and failed:
    return 'failed', failed, seconds
  # Not a failing assertion: a collection error, a crash, no tests run.
  last = (out.stdout.strip().splitlines() or ['(no output)'])[-1]
  if out.returncode < 0:
    # pytest's faulthandler wrote the crashing threads' stacks to stderr.
    print(f'pytest died of signal {-out.returncode} ({last}); the end of its '
          'stderr:\n' + '\n'.join(out.stderr.splitlines()[-60:]), flush=True)
  return f'error: pytest exit status {out.returncode}, {last}', failed, seconds


def check(mutation: Mutation) -> tuple[Mutation, str, list[str], float]:
  """(mutation, 'caught', 'SURVIVED' or the error, failing tests, seconds)."""
  with tempfile.TemporaryDirectory(prefix='capsjax-mutant-') as scratch:
    root = os.path.join(scratch, 'main')
    copy_tree(root)
    apply(mutation, root)
    outcome, failed, seconds = run_tests(mutation, root)
    crash = ''
    if outcome.startswith('error: pytest exit status -'):
      # A process killed by a signal is run once more, so that one crash
      # at exit (seen once, after the summary had reported the failure)
      # does not decide the outcome; the row still names the crash.
      crash = f'; the first run: {outcome[len("error: "):]}'
      outcome, failed, more = run_tests(mutation, root)
      seconds += more
  result = {'failed': 'caught', 'passed': 'SURVIVED'}.get(outcome,
                                                         outcome.upper())
  result += crash
  print(f'{mutation.name}: {result} ({seconds:.0f} s) {" ".join(failed)}',
        flush=True)
  return mutation, result, failed, seconds


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='',
                      help='comma-separated mutation names (default: all)')
  parser.add_argument('--ci', action='store_true',
                      help=f'the subset CI runs: {",".join(CI_SUBSET)}')
  parser.add_argument('--no-control', action='store_true',
                      help='skip the unmutated run (where its tests have just '
                      'passed on this tree)')
  parser.add_argument('--jobs', type=int, default=1,
                      help='mutations checked at a time (default 1)')
  parser.add_argument('--list', action='store_true',
                      help='print the mutations and exit')
  args = parser.parse_args()
  if args.ci and args.only:
    parser.error('--ci and --only choose the mutations: give one of them.')
  if args.jobs < 1:
    parser.error(f'--jobs must be at least 1, got {args.jobs}.')
  names = {m.name for m in MUTATIONS}
  chosen = ([n for n in args.only.split(',') if n] or
            (list(CI_SUBSET) if args.ci else [m.name for m in MUTATIONS]))
  unknown = sorted(set(chosen) - names)
  if unknown:
    parser.error(f'unknown mutations {unknown}; known: {sorted(names)}')
  if args.list:
    for m in MUTATIONS:
      print(f'{m.name}: {m.path} ({", ".join(m.tests)})')
    return 0
  selected = [m for m in MUTATIONS if m.name in chosen]
  control = Mutation('control (no mutation)', '', '', '', tuple(sorted(
      {t for m in selected for t in m.tests})))
  start = time.time()
  if not args.no_control:
    with tempfile.TemporaryDirectory(prefix='capsjax-control-') as scratch:
      root = os.path.join(scratch, 'main')
      copy_tree(root)
      outcome, failed, seconds = run_tests(control, root)
    result = {'passed': 'passed', 'failed': 'FAILED ' + ' '.join(failed)
              }.get(outcome, outcome.upper())
    print(f'{control.name}: {result} ({seconds:.0f} s)', flush=True)
    if outcome != 'passed':
      return 1
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    rows = list(pool.map(check, selected))
  print('\n| mutation | file | tests run | result | first failing test |')
  print('|---|---|---|---|---|')
  for mutation, result, failed, seconds in rows:
    shown = result if result.startswith('caught') else f'**{result.lower()}**'
    print(f'| {mutation.name} | {mutation.path} | {", ".join(mutation.tests)} '
          f'| {shown} ({seconds:.0f} s) | {failed[0] if failed else "-"} |')
  caught = sum(result.startswith('caught') for _, result, _, _ in rows)
  print(f'{caught} of {len(rows)} mutations caught in '
        f'{time.time() - start:.0f} s.')
  return 0 if caught == len(rows) else 1


if __name__ == '__main__':
  sys.exit(main())
