import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
if sys.argv[3] == '1':
    print('arena', libc.mallopt(-8, ctypes.c_int(1)), 'mmap', libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(2**30)), 'trim', libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2**31-1)))
sys.argv = sys.argv[:3]
exec(open('results/benchmarks/cpu_vs_torch/profile/faults.py').read())
