#!/usr/bin/env bash
cd /work/runs/em_authors
while pgrep -f "chain[23].sh" >/dev/null; do sleep 10; done
./run.sh run init_paper_within_window smoke,authors 0 --config.model_options.init=paper --config.model_options.normalize_across_positions=False
