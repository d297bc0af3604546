import glob, gzip, json, collections, sys
f = sorted(glob.glob(sys.argv[1] + '/**/*.trace.json.gz', recursive=True))[-1]
ev = json.load(gzip.open(f)); ev = ev['traceEvents'] if isinstance(ev, dict) else ev
tot = collections.Counter()
skip = ('$', 'Thunk', 'Slinky', 'Pjit', 'PjRt', 'Tfrt')
for e in ev:
    if e.get('ph') == 'X' and not e['name'].startswith(skip): tot[e['name']] += e['dur']
n = int(sys.argv[2]) if len(sys.argv) > 2 else 3
count = collections.Counter(e['name'] for e in ev if e.get('ph') == 'X' and not e['name'].startswith(skip))
print('sum of ops', sum(tot.values())/n/1e3, 'ms;', sum(count.values())/n, 'kernel launches per step')
for k, t in tot.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 30): print(f'{t/n/1e3:8.1f} {k}')
print([k for k in tot if k.startswith('dot')])
