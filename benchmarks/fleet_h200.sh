#!/bin/bash
# Issue 26 on one H200: plain `lipstream serve` against `lipstream serve --replicas 1` (Ray Serve: the front
# and one engine replica), the same avatars (4 of 1280x720@25) and the same serve-bench rows: N live
# sessions from aiortc clients in their own processes speaking over the WebSocket, a render job beside them;
# then render jobs alone (`lipstream render --server`, process wall, three each).
# Default flags otherwise. Both servers start on the compiled packages that STAGE=render of
# benchmarks/issue28_h200.sh built in .h200/ur/cache (else Inductor, the second server's cache warm).
# Issued right after that call (the machine stays warm 30 s; /tmp/site holds its wheels), carrying .whl-ray
# (`bash benchmarks/h200_wheels.sh`: Ray Serve's dependencies and Ray without its jars, in one call):
#   NS=16,20,16,20 COMMIT=<sha> bash benchmarks/fleet_h200.sh
# WATCH_S=5 (default; 0: off): $OUT/<server>_watch.txt, the engines' /metrics process figures and top, every 5 s.
# PROFILE=25 NS=16 ...: py-spy of the engine's process 25 s into the rows (its wheel in .whl-diag, carried with
# STAGE=render), both servers.
# INGRESSES="ray haproxy" ...: the fleet behind Ray's proxy, then behind HAProxy (`--ingress haproxy`).
# Issue 27 (nvidia-h200-x2, one engine per GPU; the one-GPU figures are this script's replicas1 rows):
#   SKIP_PLAIN=1 REPLICAS=2 NS=32,40,44 JOBS=8 KILL=1 COMMIT=<sha> bash benchmarks/fleet_h200.sh
#   python benchmarks/fleet_chart.py X1/replicas1_together/fleet_gpus.json X2/replicas2_together/fleet_gpus.json -o docs/fleet_gpus.svg
set -u
[ -d /tmp/site/av ] || { echo "/tmp/site has no PyAV: run STAGE=render of benchmarks/issue28_h200.sh first"; exit 0; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-ray .whl-ray/*.whl 2>&1 \
  | grep -v "^$" | tail -3
python3 - <<'PY'  # unzip Ray keeping its files' modes (gcs_server and raylet are executables)
import os, zipfile
with zipfile.ZipFile(".whl-ray/ray-lite.zip") as z:
    for info in z.infolist():
        path = z.extract(info, "/tmp/site-ray")
        if info.external_attr >> 16:
            os.chmod(path, (info.external_attr >> 16) & 0o777)
PY
export PYTHONPATH=/tmp/site:/tmp/site-ray:$PWD/src LIPSTREAM_COMMIT=${COMMIT:-?} TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor \
  PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
[ -d $PWD/.h200/ur/cache/aot ] && export LIPSTREAM_CACHE=$PWD/.h200/ur/cache TORCHINDUCTOR_CACHE_DIR=$PWD/.h200/ur/cache/inductor
python3 -c "import av, aiortc, fastapi, ray, ray.serve, torch; print('ray', ray.__version__, 'fastapi', fastapi.__version__, 'torch', torch.__version__)" || exit 0
W=$PWD/.h200-fleet; mkdir -p $W
NS=${NS:-16,20,16,20}
t=$(date +%s.%N)
[ -d $W/avatars ] || python3 - <<PY 2>&1 | tail -2
from pathlib import Path
from lipstream.cli import load_models
from lipstream.bench.scenarios import _avatar
from lipstream.fixtures import speech_like, write_audio
m = load_models(None, "cuda", True, "auto")
for k in range(4):
    _avatar(Path("$W"), f"p{k}", m, 1280, 720, 25, k)
write_audio("$W/job.wav", speech_like(20.0, 16000, seed=7), 16000)
print("avatars built")
PY
echo "avatars_s $(python3 -c "import time; print(round(time.time()-$t,1))")"
start_server() {  # log name, extra serve flags
  rm -rf $W/data
  t0=$(date +%s.%N)
  python3 -m lipstream.cli serve --avatars $W/avatars --random-weights --sessions-per-key 64 --port 8000 --data $W/data $2 ${SERVE_FLAGS:-} \
    > $OUT/$1.log 2>&1 &
  SPID=$!
  for i in $(seq 800); do
    python3 -c "import httpx,sys; sys.exit(0 if httpx.get('http://127.0.0.1:8000/readyz').status_code==200 else 1)" 2>/dev/null && break
    kill -0 $SPID 2>/dev/null || { echo "server died"; tail -20 $OUT/$1.log; return 1; }
    sleep 0.5
  done
  echo "$1: ready after $(python3 -c "import time; print(round(time.time()-$t0,1))") s (process start to /readyz 200)"
  grep -m3 -oE "(live engine: on the compiled packages, )?steps \{[^}]*\}[^\"]*|cannot be captured[^\"]*" $OUT/$1.log  # each bucket's step: packages vs Inductor
}
stop_server() {
  t0=$(date +%s.%N); kill -TERM $SPID; wait $SPID; echo "server exit $? after SIGTERM, $(python3 -c "import time; print(round(time.time()-$t0,1))") s"
}
# the monologue's 1080p avatar beside the four 720p ones, for the render jobs submitted together (fleet_gpus.py)
MONO=$PWD/.h200/ur/work
# NO_MONO=1: without it (its idle loop beside the sessions'); SERVE_FLAGS: more flags for both servers
if [ -n "${NO_MONO:-}" ]; then rm -rf $W/avatars/anchor
elif [ -d $MONO/avatars/anchor ] && [ ! -d $W/avatars/anchor ]; then cp -r $MONO/avatars/anchor $W/avatars/; fi
profile() {  # name: PROFILE=S: S s into the rows, 10 s of py-spy on the engine's process (plain: the server;
  # the fleet: its replica actor), every thread with --idle, then the GIL's holders (--gil): who the core thread waits for
  [ -n "${PROFILE:-}" ] || return 0
  sleep $PROFILE
  local pid=$SPID; [ "$1" != plain ] && pid=$(pgrep -f "ServeReplica:.*$ENGINE_NAME" | head -1)
  [ -n "$pid" ] || { echo "profile: no engine process"; return 0; }
  PATH=/tmp/site-ray/bin:/tmp/site/bin:$PATH py-spy record --idle --threads -r 100 -d 10 --nonblocking --format raw -o $OUT/$1_pyspy_idle.txt -p $pid > /dev/null 2>&1
  PATH=/tmp/site-ray/bin:/tmp/site/bin:$PATH py-spy record --gil --threads -r 100 -d 10 --nonblocking --format raw -o $OUT/$1_pyspy_gil.txt -p $pid > /dev/null 2>&1
  echo "profile $1 (pid $pid): $(wc -c < $OUT/$1_pyspy_idle.txt 2>/dev/null) + $(wc -c < $OUT/$1_pyspy_gil.txt 2>/dev/null) bytes"
}
sample_processes() {  # name: every WATCH_S s (5; 0: none) while the rows run, the engines' own process figures from /metrics
  # (CPU seconds, memory, garbage collections and their pauses, frames late; per replica in a fleet) and the
  # host's busiest processes (Ray's proxy, the front, the replica, the encoders): what grows row by row
  [ "${WATCH_S:-5}" = 0 ] && return 0
  while sleep ${WATCH_S:-5}; do
    echo "== $(date +%s.%N | cut -c1-14)"
    curl -s -m 3 127.0.0.1:8000/metrics | grep -E '^(process_(cpu_seconds_total|resident_memory_bytes)|lipstream_gc_pause_seconds_(sum|count)|lipstream_live_(frames_late|sessions)|lipstream_offline_frames)'
    top -b -c -n 2 -d 1 -w 220 | awk '/^top -/{n++} n==2' | sed -n "8,24p" | cut -c1-220  # the 2nd frame: the last second's %CPU; -c: Ray's process titles
  done >> $OUT/$1_watch.txt 2>&1
}
ENGINE_NAME=engine
row() {  # name: serve-bench rows $NS with the render job (the sessions on the 720p avatars)
  profile $1 & local prof=$!
  sample_processes $1 & local watcher=$!
  timeout ${BENCH_T:-280} python3 -m lipstream.cli serve-bench --sessions $NS --seconds 12 --render-audio $W/job.wav \
    --avatar p0 --avatar p1 --avatar p2 --avatar p3 \
    -o $OUT/$1 2>&1 | grep -v "^report" | tail -3
  # every row in the call's output (N, p50/p95/p99, late, missing, first frame, the job beside), whatever comes back
  grep -E "^\| [0-9]" $OUT/$1/serve_bench.md 2>/dev/null | cut -d'|' -f2,4,8,9,11,12
  kill $watcher 2>/dev/null
  wait $prof
}
jobs() {  # name: three render jobs alone, each a `lipstream render --server` process (submit to MP4 written)
  for k in 1 2 3; do
    local t=$(date +%s.%N)
    python3 -m lipstream.cli render --server http://127.0.0.1:8000 --avatar p0 --audio $W/job.wav -o $W/$1_$k.mp4 \
      >> $OUT/$1_jobs.txt 2>&1
    echo "$1 job $k: rc $? process wall $(python3 -c "import time; print(round(time.time()-$t,2))") s"
  done
}
together() {  # name, gpus: J monologue render jobs submitted together (jobs per minute); KILL=1: a replica killed
  [ -d $W/avatars/anchor ] || return 0
  timeout ${TOGETHER_T:-200} python3 benchmarks/fleet_gpus.py --gpus $2 --avatar anchor --audio $MONO/speech.wav \
    --jobs ${JOBS:-4} ${KILL:+--kill} --live-report $OUT/$1/serve_bench.json -o $OUT/$1_together 2>&1 | tail -3 | cut -c1-1500
}
R=${REPLICAS:-1}
[ -z "${SKIP_PLAIN:-}" ] && start_server plain "" && { row plain; jobs plain; together plain 1; stop_server; }
for ingress in ${INGRESSES:-ray}; do  # INGRESSES="ray haproxy": the fleet behind each (`--ingress`), in turn
  name=replicas$R; [ $ingress = ray ] || name=replicas${R}_$ingress
  start_server $name "--replicas $R --ingress $ingress" && { row $name; jobs $name; together $name $R
    curl -s 127.0.0.1:8000/metrics | grep -E "^lipstream_(ready|live_sessions|offline_frames|fleet)" > $OUT/${name}_metrics.txt; stop_server; }
done
# everything as one file: a device call brings back 8 files at most (12 here lost the replica's watch, profiles
# and reports on 2026-12-05)
tar czf /tmp/fleet.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/fleet.tgz $OUT/
find $OUT -size +15M -delete
