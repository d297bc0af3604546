#!/usr/bin/env bash
# The native test files with both native libraries (oneDNN handlers, fused EM
# kernel) built with AddressSanitizer and UndefinedBehaviorSanitizer; any
# report aborts the run. Python is not built with them, so their runtimes are
# preloaded. A planted heap overflow is checked first: a sanitizer that would
# not catch it makes the run fail, not pass.
#   bash tools/sanitized_tests.sh [ONEDNN_MAX_CPU_ISA value, default AVX2]
set -euo pipefail
cd "$(dirname "$0")/.."
export CAPSJAX_SANITIZE=address,undefined
export CAPSJAX_CACHE_DIR="${CAPSJAX_CACHE_DIR:-/tmp/capsjax-sanitized-cache}"
export ONEDNN_MAX_CPU_ISA="${1:-AVX2}"
cxx="${CXX:-g++}"
preload="$("$cxx" -print-file-name=libasan.so) $("$cxx" -print-file-name=libubsan.so)"
# Leaks of the interpreter and XLA are not ours; a report in our code aborts.
asan_options=detect_leaks=0:abort_on_error=1

canary=$(mktemp -d)
trap 'rm -rf "$canary"' EXIT
cat > "$canary/overflow.cc" <<'CC'
#include <vector>
extern "C" int Overflow(int n) { std::vector<int> v(4); return v.data()[n]; }
CC
if LD_PRELOAD="$preload" ASAN_OPTIONS=$asan_options python -c "
import ctypes, pathlib
from capsjax.kernels import native
lib = ctypes.CDLL(str(native.build(pathlib.Path('$canary/overflow.cc'), 'canary_', ['-O1'])))
lib.Overflow(6)" 2> "$canary/report"; then
  echo "the sanitizers did not catch a planted heap overflow" >&2
  exit 1
fi
grep -q 'heap-buffer-overflow' "$canary/report" || {
  cat "$canary/report" >&2; echo "no AddressSanitizer report" >&2; exit 1; }
echo "planted heap overflow caught by AddressSanitizer"

LD_PRELOAD="$preload" ASAN_OPTIONS=$asan_options \
  python -m pytest -q -p no:cacheprovider tests/test_onednn.py \
  tests/test_onednn_bf16.py tests/test_cpu_convolutions.py \
  tests/test_em_kernel.py tests/test_native_isa.py
