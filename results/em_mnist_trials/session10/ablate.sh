#!/usr/bin/env bash
# The authors' set with one option at a time set back to the paper set's value.
cd /work/runs/em_authors
while pgrep -f "em_authors/authors_s0" >/dev/null; do sleep 10; done
./run.sh run activation_paper smoke,authors 0 --config.model_options.activation_form=paper
./run.sh run init_paper smoke,authors 0 --config.model_options.init=paper
./run.sh run class_lambda_same smoke,authors 0 --config.model_options.class_inverse_temperature=None
./run.sh run within_window smoke,authors 0 --config.model_options.normalize_across_positions=False
./run.sh run no_momentum smoke,authors 0 --config.model_options.center_momentum=0.0
./run.sh run floor_1e-4 smoke,authors 0 --config.model_options.variance_epsilon=0.0001
