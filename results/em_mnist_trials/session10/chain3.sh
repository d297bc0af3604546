#!/usr/bin/env bash
cd /work/runs/em_authors
while pgrep -f chain2.sh >/dev/null; do sleep 10; done
./run.sh run authors smoke,authors 1
./run.sh run init_paper smoke,authors 1 --config.model_options.init=paper
