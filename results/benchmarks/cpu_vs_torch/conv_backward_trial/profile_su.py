"""Session 11: XLA profile of Su's capsule model's train step at batch 128 with the shipped conv2d (IMPL=patches|direct|space_to_depth overrides it). PYTHONPATH=. python this; then profile/readtrace.py on /tmp/capsjax_profile/trace_two_digit_capsnet."""
import sys; sys.argv=['x','two_digit_capsnet','128']
from capsjax import layers
_c=layers.conv2d
import os
if os.environ.get('IMPL'): layers.conv2d=lambda x,k,s=1,p='VALID',i=None: _c(x,k,s,p,os.environ['IMPL'])
sys.path.insert(0,'results/benchmarks/cpu_vs_torch/profile')
from experiments import launcher
exec(open('results/benchmarks/cpu_vs_torch/profile/trace.py').read())
