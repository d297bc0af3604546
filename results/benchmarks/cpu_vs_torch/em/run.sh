#!/usr/bin/env bash
# The matrix-capsule models against their PyTorch reference, and the
# parent-major EM routing against the child-major one (issue: CPU speed).
# From the repository root, with pip install -e '.[bench]':
#   OLD=/path/to/worktree/of/e1ba79a bash results/benchmarks/cpu_vs_torch/em/run.sh
# OLD (optional): a checkout of e1ba79a (child-major routing) for the A/B,
# its processes alternated with this checkout's, 3 rounds.
set -u
D=results/benchmarks/cpu_vs_torch/em
python -m benchmarks.check_em_reference | tee $D/check_em_reference.log
for spec in "matrix_capsnet_mnist:smoke 32 10" "matrix_capsnet_mnist:smoke 64 10" \
            "matrix_capsnet_mnist:smoke 128 5" "matrix_capsnet_mnist 8 3" \
            "matrix_capsnet_mnist 16 2"; do
  set -- $spec
  name=$(echo $1 | tr ':' '_')_b$2
  python -m experiments.benchmark --model=$1 --batch_size=$2 --steps=$3 --rounds=3 \
      --compare=torch --output=$D/$name.json 2>&1 | grep -v "^$" > $D/$name.log
  tail -1 $D/$name.log
done
[ -n "${OLD:-}" ] || exit 0
for spec in "matrix_capsnet_mnist 8 3" "matrix_capsnet_mnist:smoke 32 30"; do
  set -- $spec
  for round in 1 2 3; do
    for dir in "$OLD" "$PWD"; do
      row=$(cd "$dir" && PYTHONPATH="$dir" python -m experiments.benchmark --model=$1 \
            --batch_size=$2 --steps=$3 2>&1 | grep -E "^\| $1 " | tail -1)
      echo "round $round $(cd "$dir" && git rev-parse --short HEAD) $row" | tee -a $D/parent_major_ab.log
    done
  done
done
