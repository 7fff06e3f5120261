"""Summarise py-spy raw (--gil) output: samples per thread group, top self/inclusive frames per group."""
import collections, re, sys
lines = open(sys.argv[1]).read().splitlines()
groups = collections.Counter(); incl = collections.defaultdict(collections.Counter); selfc = collections.defaultdict(collections.Counter)
for l in lines:
    try:
        stack, n = l.rsplit(' ', 1); n = int(n)
    except ValueError:
        continue
    frames = stack.split(';')
    name = re.sub(r'\(\d+\)', '', frames[0])
    name = re.sub(r'_\d+$', '', name.split(':')[-1].strip())
    if 'MainThread' in frames[0]:  # live-bench's own thread
        name = 'main:bench' if any('run_sessions' in f for f in frames) else 'main:other'
    groups[name] += n
    seen = set()
    for f in frames[1:]:
        k = f.split(' (')[0] + ' ' + f.rsplit('/', 1)[-1].rstrip(')')
        k2 = f.split(' (')[0]
        if k2 not in seen:
            incl[name][k2] += n; seen.add(k2)
    selfc[name][frames[-1].split(' (')[0] + ' ' + frames[-1].rsplit('/', 1)[-1].rstrip(')')] += n
print('samples per thread group:', dict(groups.most_common()))
for g, _ in groups.most_common(6):
    print(f'\n== {g}: inclusive'); [print(f'  {n:6d} {k}') for k, n in incl[g].most_common(25)]
    print(f'== {g}: self'); [print(f'  {n:6d} {k}') for k, n in selfc[g].most_common(15)]
