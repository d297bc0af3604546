#!/usr/bin/env bash
cd /work/runs/em_authors
./run.sh run within_window smoke,authors 0 --config.model_options.normalize_across_positions=False
./run4.sh run class_lambda_same smoke,authors 0 --config.model_options.class_lambda_scale=1.0
./run.sh run no_momentum smoke,authors 0 --config.model_options.center_momentum=0.0
./run.sh run floor_1e-4 smoke,authors 0 --config.model_options.variance_epsilon=0.0001
