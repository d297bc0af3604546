"""A stand-in experiment for tests of experiments.reproduce: no JAX.

  python -m tests.fake_experiment --workdir=W --steps=N [--step_s=S] [--fail]

Like a training run it resumes (its step is kept in W/step.txt), saves
(taking --save_s) and exits 130 / 143 / 129 on SIGINT / SIGTERM / SIGHUP,
stops without saving on a second signal, and writes W/summary.json when done; --fail
exits 1 at once.
"""

import argparse
import json
import os
import signal
import sys
import time


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--steps', type=int, required=True)
  parser.add_argument('--step_s', type=float, default=0.02)
  parser.add_argument('--save_s', type=float, default=0.0)
  parser.add_argument('--fail', action='store_true')
  args = parser.parse_args()
  if args.fail:
    print('fake experiment: failing as asked', flush=True)
    sys.exit(1)
  os.makedirs(args.workdir, exist_ok=True)
  step_file = os.path.join(args.workdir, 'step.txt')
  step = int(open(step_file).read()) if os.path.exists(step_file) else 0
  print(f'fake experiment: starting at step {step}', flush=True)
  stop = []
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(signum) != signal.SIG_IGN:
      signal.signal(signum, lambda signum, frame: stop.append(signum))
  while step < args.steps:
    time.sleep(args.step_s)
    step += 1
    if stop:
      # Saving takes save_s; a second signal meanwhile stops at once, with
      # nothing saved (as a training run does).
      time.sleep(args.save_s)
      if len(stop) > 1:
        print('fake experiment: second signal, stopped without saving',
              flush=True)
        sys.exit(1)
      with open(step_file, 'w') as f:
        f.write(str(step))
      print(f'fake experiment: stopped at step {step}', flush=True)
      sys.exit(128 + stop[0])
  with open(os.path.join(args.workdir, 'summary.json'), 'w') as f:
    json.dump({'steps': step, 'epochs': step / 10,
               'test': {'error': 0.25, 'accuracy': 0.75},
               'validation': {'error': 0.2, 'accuracy': 0.8},
               'train_images_per_s': 100.0, 'device': 'cpu:fake',
               'git_commit': 'abcdef0123'}, f)
  print(f'fake experiment: finished at step {step}', flush=True)


if __name__ == '__main__':
  main()
