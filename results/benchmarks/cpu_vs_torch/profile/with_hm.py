import sys, runpy
from capsjax.training import host_memory
print(host_memory.retain_freed_memory())
script = sys.argv[1]; sys.argv = sys.argv[1:]
runpy.run_path(script, run_name='__main__')
