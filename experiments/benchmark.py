"""Throughput, compile time and memory of the models; routing vs its roofline.

  python -m experiments.benchmark --model=capsnet_mnist:smoke --batch_size=64 \\
      --steps=10 --output=results/benchmarks/capsnet_mnist_smoke.json
  python -m experiments.benchmark --model=matrix_capsnet_smallnorb \\
      --batch_size=64 --compile_only --model_option=remat=True
  python -m experiments.benchmark --routing_only --batch_size=32 \\
      --output=results/benchmarks/routing.json --markdown=routing.md
  python -m experiments.benchmark --model=two_digit_capsnet --batch_size=32 \\
      --sweep=image_size:28,40,56
  python -m experiments.benchmark --model=matrix_capsnet_mnist --train_only \\
      --sweep='implementation:xla,pallas;dtype:float32,bfloat16;batch_size:16,64'
  python -m experiments.benchmark --model=capsnet_mnist --conv_layout=nchw

``--model`` is a registry name (``capsnet``, ``matrix_capsnet``, ...: default
options, default training config of its family) or a config reference
``FILE[:VARIANT]`` resolved to ``experiments/configs/FILE.py``
``get_config(VARIANT)`` (``capsnet_mnist:smoke``, ``matrix_capsnet_smallnorb``).

Model rows time the real jitted train step (``make_steps`` of
``training.vector_capsules`` / ``training.matrix_capsules``, state donated,
as ``training.fit`` runs it) and eval step on random uint8 images:
images/s from the median step time over ``--steps`` timed calls after
``--warmup`` untimed ones, every call synchronised with
``jax.block_until_ready``. ``compile_s`` is the trace +
lower + compile time (the first call's extra cost). Memory:
``peak_memory_bytes`` is the device's ``peak_bytes_in_use`` where the device
reports it (GPU) and otherwise XLA's compiled memory analysis of the train
step (arguments + outputs + temporaries - donated aliases), named in
``peak_memory_source``; ``peak_rss_bytes`` is the process's peak resident
set (``ru_maxrss``), which also holds the runtime, the compiler and every
earlier row of the same invocation (run one model per invocation to read it).

Routing rows time ``routing.dynamic_routing`` / ``routing.em_routing`` alone,
forward and forward + backward, against ``capsjax.flops``'s analytical counts
and XLA's ``cost_analysis``; ``floor_s`` = max(flops / peak, bytes /
bandwidth), ``fraction_of_floor`` = floor_s / measured_s (1.0 is the
roofline). Peaks: the datasheet table in ``capsjax.flops`` for known GPUs;
on a CPU a float32 matmul and a large elementwise copy are timed at startup
(or pass --peak_gflops / --bandwidth_gbs).

``--sweep`` takes a grid, ``KEY:V1,V2;KEY2:V1,V2``: a row for each
combination. ``--train_only`` neither compiles nor times the eval step
(its fields are None). Every model row says what its compiled train step
runs (``compiled_ops``: fusions, layout changes, each cuDNN convolution's
dim_labels and layouts) and the convolutions' layout asked of XLA's GPU
compiler (``--conv_layout``: 'xla' its own choice, 'nhwc' or 'nchw'
forced through XLA_FLAGS before the backend starts; ``conv_layout``,
``xla_flags``).

``--dtype=bfloat16`` measures a mixed-precision step: float32 master
parameters and optimiser, bfloat16 copies of the parameters and images for
the forward and backward pass (routing keeps its statistics in float32).

``--compare=torch`` times the model's PyTorch reference
(``benchmarks/torch_models.py``) in PyTorch's modes (``--torch_modes``:
eager and ``torch.compile``, float32 and bfloat16 autocast), on the CUDA GPU
when JAX computes on a GPU and on the CPU otherwise, against capsjax
in its compute dtypes (``--compare_dtypes``), in ``--rounds`` rounds that
alternate over every mode so that each sees the same machine; each mode's
median round is reported. The row leads with capsjax's best mode against
PyTorch's best (``best_ratio``), then every capsjax mode against every
PyTorch mode (``mode_ratios``). A PyTorch mode that fails (``torch.compile``
needs a working C++ toolchain, and may not support a model) is reported
failed, with the reason, and left out of the ratios. ``--model`` takes
several models, comma-separated, for one table of them all.
"""

# This module is the command (its flags -> one call); the measurements are
# benchmarks/harness.py, which other tools import without these flags.

from __future__ import annotations

from absl import app
from absl import flags

from benchmarks import harness
from experiments import launcher

_MODEL = flags.DEFINE_string(
    'model', 'capsnet_mnist:smoke',
    'Registry name (capsnet, baseline_cnn, matrix_capsnet, two_digit_baseline, '
    'two_digit_capsnet) or config FILE[:VARIANT] from experiments/configs; '
    'several, comma-separated, for a row each.')
_BATCH_SIZE = flags.DEFINE_integer(
    'batch_size', 0, 'Batch size (0: the config\'s; 32 for --routing_only).')
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps (median reported).')
_WARMUP = flags.DEFINE_integer(
    'warmup', 1, 'Untimed steps after compilation, before the timed ones.')
_DTYPE = flags.DEFINE_enum(
    'dtype', 'float32', ['float32', 'bfloat16'],
    'Compute dtype of parameters and images (bfloat16: mixed precision).')
_OUTPUT = flags.DEFINE_string(
    'output', '', 'JSON file for the rows ({"rows": [...], ...}), rewritten '
    'after each model row; "" for none.')
_MARKDOWN = flags.DEFINE_string(
    'markdown', '', 'Also write the markdown tables to this file.')
_ROUTING_ONLY = flags.DEFINE_bool(
    'routing_only', False, 'Benchmark the routing functions alone, no model.')
_ROUTING_CASES = flags.DEFINE_list(
    'routing_cases', ['dynamic_digitcaps', 'em_convcaps1', 'em_class'],
    'Routing cases for --routing_only (see ROUTING_CASES).')
_NUM_ITERATIONS = flags.DEFINE_integer(
    'num_iterations', 3, 'Routing iterations of the --routing_only cases.')
_SWEEP = flags.DEFINE_string(
    'sweep', '', 'KEY:V1,V2,...: one row per value. KEY is batch_size, '
    'num_devices, image_size (any model with an input_shape option, or the '
    'two-digit models), dtype or a model option such as num_iterations or '
    'implementation; several, KEY:...;KEY2:..., for a row per combination '
    '(--routing_only: one).')
_TRAIN_ONLY = flags.DEFINE_bool(
    'train_only', False, 'Compile and time the train step only (not the '
    'eval step).')
_CONV_LAYOUT = flags.DEFINE_enum(
    'conv_layout', 'xla', list(harness.CONV_LAYOUTS), 'Layout of the cuDNN '
    'convolutions on a GPU: xla (XLA\'s choice), or nhwc / nchw forced '
    '(XLA_FLAGS --xla_gpu_force_conv_nhwc / _nchw, set before the backend '
    'starts; no effect on a CPU).')
_MODEL_OPTIONS = flags.DEFINE_multi_string(
    'model_option', [], 'KEY=VALUE model option override, repeatable (e.g. '
    'remat=True, votes_dtype=bfloat16).')
_IMAGE_SIZE = flags.DEFINE_integer(
    'image_size', 0, 'Square input side (0: the model\'s default).')
_COMPILE_ONLY = flags.DEFINE_bool(
    'compile_only', False, 'Compile the steps and report XLA\'s memory and '
    'cost analysis without running them (for models too slow to run).')
_PEAK_GFLOPS = flags.DEFINE_float(
    'peak_gflops', 0.0, 'Peak float32 GFLOP/s for routing floors on a CPU '
    '(0: time a 2048^3 matmul at startup).')
_BANDWIDTH_GBS = flags.DEFINE_float(
    'bandwidth_gbs', 0.0, 'Memory bandwidth GB/s for routing floors on a CPU '
    '(0: time a 256 MB elementwise copy at startup).')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of parameters and inputs.')
_COMPARE = flags.DEFINE_enum(
    'compare', '', ['', 'torch'], "'torch': also time the PyTorch reference "
    'of the model (benchmarks/torch_models.py; pip install -e \'.[bench]\') '
    'in the same process, in its modes (--torch_modes), alternating with '
    'capsjax in its dtypes (--compare_dtypes), and report the ratios.')
_TORCH_MODES = flags.DEFINE_list(
    'torch_modes', list(harness.TORCH_MODES), 'With --compare=torch: the '
    'PyTorch modes timed (eager or torch.compile, float32 or bfloat16 '
    'autocast).')
_COMPARE_DTYPES = flags.DEFINE_list(
    'compare_dtypes', ['float32', 'bfloat16'], 'With --compare=torch: the '
    'capsjax compute dtypes timed against them (--dtype is always one).')
_ROUNDS = flags.DEFINE_integer(
    'rounds', 3, 'With --compare: alternating rounds of --steps timed steps '
    'each (the median round of each side is reported).', lower_bound=1)
_NUM_DEVICES = flags.DEFINE_integer(
    'num_devices', 1, 'Local devices the batch is split over (data '
    'parallelism). On a CPU, XLA_FLAGS=--xla_force_host_platform_device_count'
    '=N first makes N devices.', lower_bound=1)


def _write_rows(rows) -> None:
  """The rows so far into --output, so that a run cut short keeps them."""
  if _OUTPUT.value:
    harness.write_outputs(rows, _OUTPUT.value, '')


def benchmark() -> None:
  harness.set_conv_layout(_CONV_LAYOUT.value)
  rows = harness.run(
      model=_MODEL.value, batch_size=_BATCH_SIZE.value, steps=_STEPS.value,
      warmup=_WARMUP.value, dtype=_DTYPE.value,
      routing_only=_ROUTING_ONLY.value, routing_cases=_ROUTING_CASES.value,
      num_iterations=_NUM_ITERATIONS.value, sweep=_SWEEP.value,
      options=harness.parse_options(_MODEL_OPTIONS.value),
      image_size=_IMAGE_SIZE.value, compile_only=_COMPILE_ONLY.value,
      peak_gflops=_PEAK_GFLOPS.value, bandwidth_gbs=_BANDWIDTH_GBS.value,
      seed=_SEED.value, num_devices=_NUM_DEVICES.value,
      compare=_COMPARE.value, rounds=_ROUNDS.value,
      torch_modes=tuple(_TORCH_MODES.value),
      compare_dtypes=tuple(_COMPARE_DTYPES.value),
      train_only=_TRAIN_ONLY.value, on_row=_write_rows)
  print(harness.write_outputs(rows, _OUTPUT.value, _MARKDOWN.value))


def main(argv):
  launcher.run_command(argv, benchmark, (ValueError,))


if __name__ == '__main__':
  app.run(main, flags_parser=launcher.parse_flags)
