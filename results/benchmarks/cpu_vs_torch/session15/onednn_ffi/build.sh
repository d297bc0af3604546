#!/bin/bash
# Builds the prototype into $1 (default /tmp/libonednn_conv.so). Needs
# `pip install onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0`
# in the active environment (headers in $VIRTUAL_ENV/include, libdnnl.so.3
# in $VIRTUAL_ENV/lib).
set -e
out=${1:-/tmp/libonednn_conv.so}
here=$(dirname "$0")
ffi_include=$(python -c "import jax; print(jax.ffi.include_dir())")
g++ -O2 -std=c++17 -shared -fPIC -w -I"$ffi_include" -I"$VIRTUAL_ENV/include" \
  "$here/onednn_conv.cc" -L"$VIRTUAL_ENV/lib" -l:libdnnl.so.3 \
  -Wl,-rpath,"$VIRTUAL_ENV/lib" -o "$out"
