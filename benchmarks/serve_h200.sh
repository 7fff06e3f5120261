#!/bin/bash
# The `lipstream serve` load test on an H200: start-up to /readyz 200 (cold and warm), then
# serve-bench rows (N aiortc clients in their own processes speak over the session's WebSocket,
# a render job beside them): audio sent -> the frame's last RTP packet at the client, frames late,
# server stages, GPU use, py-spy of the server's threads; SIGTERM time.
# Rerun: a device call in the repo root (the `run` tool: $OUT comes back; carry .whl: the wheels of
# lipstream's dependencies the image lacks, docs/NOTES.md lists them), as the 67399c9 call that docs/BENCHMARKS.md reports:
#   STAGE=diag NS=none NOWARM= DELAYS=180,200 NJ=1,4,8,12,16,20 [PROF=1 PROF_AT=S] COMMIT=<sha> \
#     bash benchmarks/serve_h200.sh
# Reported in docs/BENCHMARKS.md, "`lipstream serve` under load on the H200 (issue 15, third
# session)" (67399c9, STAGE=diag) and "(issue 15, second session)" (cecdb67 STAGE=all, 688d595 and
# 1205dc1 STAGE=diag); docs/results/serve_bench_h200_*, serve_h200_*_pyspy_idle.txt. The lipstream
# package is imported from src/ through PYTHONPATH (the device has no installed copy).
# STAGE=cold: install, build 4 avatars 1280x720@25, cold server start (ready time), a smoke row, stop.
# STAGE=bench: warm server start (ready time), serve-bench rows $NS with a render job, py-spy on the server.
# STAGE=all: cold (with rows $NS0 at the default playout delay), then a warm start at PLAYOUT2 ms with rows $NS, py-spy.
# STAGE=diag: cold start; rows $NS without a job (none: no such rows) (GPU use, per-thread CPU and a py-spy of every thread during
#   the second), a row of N=$NJ with a job; then the tests stage in the time left (of TOTAL_T).
# STAGE=tests: the test suite (or TESTS) on Python 3.12 with the newest wheels (pytest-xdist carried).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | grep -v "^$" | tail -3
export PYTHONPATH=/tmp/site:$PWD/src LIPSTREAM_COMMIT=${COMMIT:-?} TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor PYTHONUNBUFFERED=1
W=$PWD/.h200-serve; mkdir -p $W
NS=${NS:-8,16,20,24}
python3 -c "import av, aiortc, fastapi, numpy, torch; print('av', av.__version__, 'aiortc', aiortc.__version__, 'fastapi', fastapi.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
if [ ! -d $W/avatars ] && [ "${STAGE:-cold}" != tests ]; then
  t=$(date +%s.%N)
  python3 - <<PY 2>&1 | tail -3
from pathlib import Path
from lipstream.cli import load_models
from lipstream.bench.scenarios import _avatar
m = load_models(None, "cuda", True, "auto")
for k in range(4):
    _avatar(Path("$W"), f"p{k}", m, 1280, 720, 25, k)
print("avatars built")
PY
  echo "avatars_s $(python3 -c "import time; print(round(time.time()-$t,1))")"
  python3 -c "from lipstream.fixtures import speech_like, write_audio; write_audio('$W/job.wav', speech_like(20.0, 16000, seed=7), 16000)"
fi
start_server() {  # log name [playout ms]
  rm -rf $W/data
  local playout=${2:-${PLAYOUT:-}}
  t0=$(date +%s.%N)
  python3 -m lipstream.cli serve --avatars $W/avatars --random-weights --sessions-per-key 64 --port 8000 --data $W/data ${playout:+--playout-delay-ms $playout} > $OUT/$1.log 2>&1 &
  SPID=$!
  for i in $(seq 600); do
    python3 -c "import httpx,sys; sys.exit(0 if httpx.get('http://127.0.0.1:8000/readyz').status_code==200 else 1)" 2>/dev/null && break
    kill -0 $SPID 2>/dev/null || { echo "server died"; tail -20 $OUT/$1.log; return 1; }
    sleep 0.5
  done
  echo "$1: ready after $(python3 -c "import time; print(round(time.time()-$t0,1))") s (process start to /readyz 200)"
  grep -o '"capacity[^,]*\|capacity [0-9]* frames/s' $OUT/$1.log | head -2
}
stop_server() {
  t0=$(date +%s.%N); kill -TERM $SPID; wait $SPID; echo "server exit $? after SIGTERM, $(python3 -c "import time; print(round(time.time()-$t0,1))") s"
}
gil_profile() {  # py-spy of the GIL's holder, PROF_AT s on, in the background
  [ -n "${PROF:-}" ] && (sleep ${PROF_AT:-60}; timeout 30 /tmp/site/bin/py-spy record --pid $SPID --nonblocking --gil --threads -f raw -r 50 -d 12 -o $OUT/gil.txt > $OUT/pyspy.log 2>&1) &
}
pyspy_summary() {  # py-spy raw output (--gil or --idle): samples per thread group, top self/inclusive frames per group
  python3 - "$1" <<'PY'
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
PY
}
gil_summary() {
  [ -f $OUT/gil.txt ] && pyspy_summary $OUT/gil.txt > $OUT/gil_summary.txt && gzip -f $OUT/gil.txt
  tail -3 $OUT/pyspy.log 2>/dev/null
}
run_tests() {  # limit in s: the suite (TESTS: some of it) on Python 3.12 with the newest wheels, 8 workers
  timeout $1 python3 -m pytest -q -p no:cacheprovider -n ${WORKERS:-8} ${TESTS:-tests} 2>&1 | tail -25
}
case ${STAGE:-cold} in
cold)
  start_server serve_cold || exit 0
  timeout 120 python3 -m lipstream.cli serve-bench --sessions 4 --seconds 6 --no-warmup --server-pid $SPID -o $OUT/smoke 2>&1 | tail -4
  stop_server ;;
all)
  start_server serve_cold || exit 0
  timeout ${BENCH0_T:-150} python3 -m lipstream.cli serve-bench --sessions ${NS0:-16,23} --seconds 12 --render-audio $W/job.wav --server-pid $SPID -o $OUT/sb250 2>&1 | tail -6
  stop_server
  start_server serve_warm ${PLAYOUT2:-230} || exit 0
  gil_profile
  timeout ${BENCH_T:-200} python3 -m lipstream.cli serve-bench --sessions $NS --seconds 12 --render-audio $W/job.wav --server-pid $SPID --codec ${CODEC:-any} -o $OUT/sb 2>&1 | tail -8
  stop_server
  gil_summary ;;
diag)
  T0=$(date +%s)
  start_server serve_cold || exit 0
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 > $OUT/gpu.csv 2>&1 &
  GPID=$!
  [ -n "${SNAP_AT:-}" ] && (sleep $SNAP_AT; top -b -H -n 2 -d 2 -w 250 | awk '/^top -/{n++} n==2' | head -70 > $OUT/top_threads.txt
   ps -eo pid,ni,pcpu,rss,comm --sort=-pcpu | head -45 > $OUT/ps.txt) &
  if [ -n "${PROF:-}" ]; then
    (sleep ${PROF_AT:-45}; timeout 30 /tmp/site/bin/py-spy record --pid $SPID --nonblocking --idle --threads -f raw -r 50 -d 10 -o $OUT/idle.txt > $OUT/pyspy.log 2>&1) &
  fi
  [ "${NS:-}" != none ] && timeout ${BENCH_T:-200} python3 -m lipstream.cli serve-bench --sessions ${NS:-8,16,23} --seconds 12 --server-pid $SPID ${DELAYS:+--playout-delay-ms $DELAYS} -o $OUT/sb_nojob 2>&1 | grep -v "^report" | tail -8
  timeout ${BENCHJ_T:-90} python3 -m lipstream.cli serve-bench --sessions ${NJ:-16} --seconds 12 ${NOWARM---no-warmup} --render-audio $W/job.wav --server-pid $SPID ${DELAYS:+--playout-delay-ms $DELAYS} -o $OUT/sb_job 2>&1 | grep -v "^report" | tail -4
  kill $GPID
  stop_server
  [ -f $OUT/idle.txt ] && pyspy_summary $OUT/idle.txt > $OUT/idle_summary.txt && rm -f $OUT/idle.txt $OUT/pyspy.log
  rm -f $OUT/sb_*/serve_bench.md  # few files come back: the reports are rebuilt from the JSON
  left=$(( ${TOTAL_T:-570} - ($(date +%s) - T0) ))
  echo "tests: $left s left"
  if [ $left -gt 60 ]; then
    run_tests $left
  fi ;;
bench)
  start_server serve_warm || exit 0
  gil_profile
  timeout ${BENCH_T:-420} python3 -m lipstream.cli serve-bench --sessions $NS --seconds 12 --render-audio $W/job.wav --server-pid $SPID --codec ${CODEC:-any} -o $OUT/sb 2>&1 | tail -12
  stop_server
  gil_summary ;;
tests)
  run_tests ${TEST_T:-400} ;;
esac
find $OUT -size +15M -delete
ls $OUT
