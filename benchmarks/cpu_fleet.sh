#!/bin/bash
# The fleet (`lipstream serve --replicas 1`, Ray Serve) against plain `lipstream serve` on a 2-core CPU, tiny random
# networks: what Ray's processes cost where cores are scarce. Not a GPU figure: docs/BENCHMARKS.md, "Fleet".
#
#   bash benchmarks/cpu_fleet.sh STAGE [STAGE...]       # knobs as VAR=value before it
#
# Every stage: VENV (a virtual environment with lipstream's dependencies and the ray extra; default ./.venv, else
# the python on PATH), W (its work folder, /tmp/fleet-STAGE). This tree's src/ is imported (PYTHONPATH).
# The live stages serve a 320x180 avatar of the tiny networks ("small", made once under W), capacity CAP frames/s.
#
# jobs     plain against `--replicas 1`: four `render --server` jobs of 3 s of speech each: client wall, and
#          queued/ran from the jobs' own timestamps. AVATARS/AVATAR: the avatar the jobs render (default: `make
#          demo`'s demo-out/avatars, anchor-360p, as measured; else the small avatar). MODES ("plain replicas1").
# nice     the fleet's priority: plain, `--replicas 1` at the commit OLD (a git worktree of it, when given) and of
#          this tree, each under serve-bench rows NS (1,1,1) of one session beside HOGS (2) busy processes at
#          nice 10 (as serve-bench's clients are). CAP (30). Prints each server's start and its processes' nice.
# ingress  what the fleet's ingress costs: `--replicas 1` behind Ray Serve's proxy, then behind HAProxy
#          (`--ingress haproxy`), under serve-bench rows NS (4,4) at CAP (120) frames/s (more than 2 cores keep
#          up with: the sockets' messages are the load looked at): the CPU seconds of Ray's proxy, HAProxy, the
#          front and the engine over the rows (/proc, user + system), and the rows.
#
#   OLD=de06db2 HOGS=2 bash benchmarks/cpu_fleet.sh nice
#   CAP=120 NS=4,4 bash benchmarks/cpu_fleet.sh ingress
set -u
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
[ -x "$VENV/bin/python" ] && export PATH=$VENV/bin:$PATH
export PYTHONPATH=$PWD/src RAY_USAGE_STATS_ENABLED=0 LIPSTREAM_API_KEYS="" LIPSTREAM_SERVER=""
PORT=8765

secs() { python -c "import time; print(round(time.time() - $1, 1))"; }

small_avatar() {  # folder: a 320x180 avatar "small" of the tiny random networks under folder/avatars (kept if there)
  [ -d "$1/avatars/small" ] && return 0
  mkdir -p "$1"
  python - "$1" <<'PY' > /dev/null 2>&1 || { echo "the avatar failed"; exit 1; }
import sys
from pathlib import Path
from lipstream.fixtures.avatar import tracked_avatar
from lipstream.models import load_musetalk
m = load_musetalk(random_weights=True, size="tiny", device="cpu", seed=0)
tracked_avatar(Path(sys.argv[1]), "small", m.vae, m.fingerprints["vae"], width=320, height=180, seed=0)
PY
}

serve_cpu() {  # log, avatars, more flags: a tiny-network server on the CPU; waits for /readyz, prints the time
  local log=$1 avatars=$2; shift 2
  local t; t=$(date +%s.%N)
  python -m lipstream.cli serve --avatars "$avatars" --data "$log.data" --random-weights --random-size tiny \
    --device cpu --port $PORT --live-preset cpu "$@" > "$log" 2>&1 &
  S=$!
  local i
  for i in $(seq 400); do curl -sf http://127.0.0.1:$PORT/readyz > /dev/null && break; sleep 0.5; done
  echo "$(basename "$log" .log) ready after $(secs $t) s"
}

stage_jobs() {
  local W=${W:-/tmp/fleet-jobs}; mkdir -p "$W"
  python -c "
from lipstream.fixtures import speech_like, write_audio
write_audio('$W/job.wav', speech_like(3.0, 16000, seed=7), 16000)"
  local avatars=${AVATARS:-demo-out/avatars} avatar=${AVATAR:-anchor-360p}
  if [ ! -d "$avatars/$avatar" ]; then
    echo "no $avatars/$avatar (make demo): the jobs render the small avatar"
    small_avatar "$W"; avatars=$W/avatars avatar=small
  fi
  local mode extra k t
  for mode in ${MODES:-plain replicas1}; do
    extra=(); [ "$mode" = replicas1 ] && extra=(--replicas 1)
    rm -rf "$W/$mode.log.data"
    serve_cpu "$W/$mode.log" "$avatars" "${extra[@]}"
    for k in 1 2 3 4; do
      t=$(date +%s.%N)
      python -m lipstream.cli render --server http://127.0.0.1:$PORT --avatar "$avatar" --audio "$W/job.wav" \
        -o "$W/$mode-$k.mp4" > "$W/$mode-$k.txt" 2>&1
      echo "$mode job $k: rc $? wall $(secs $t) s"
    done
    curl -s http://127.0.0.1:$PORT/v1/jobs | python -c "
import json, sys
d = json.load(sys.stdin); jobs = d['jobs'] if isinstance(d, dict) else d
for j in sorted(jobs, key=lambda j: j['created_at']):
    print('  queued %.3f s, ran %.3f s' % (j['started_at'] - j['created_at'], j['finished_at'] - j['started_at']))
"
    kill -INT $S; wait $S
  done
}

stage_nice() {
  local W=${W:-/tmp/fleet-nice}; rm -rf "$W"; mkdir -p "$W"
  small_avatar "$W"
  [ -n "${OLD:-}" ] && { git worktree remove --force "$W-old" 2>/dev/null; git worktree add -q --detach "$W-old" "$OLD"; }
  local mode src extra hogs k
  for mode in plain old new; do
    [ $mode = old ] && [ -z "${OLD:-}" ] && continue
    src=$PWD/src; extra=(--replicas 1)
    [ $mode = plain ] && extra=()
    [ $mode = old ] && src=$W-old/src
    PYTHONPATH=$src serve_cpu "$W/$mode.log" "$W/avatars" --capacity-fps ${CAP:-30} "${extra[@]}"
    ps -eo ni,args | grep -E "ray::ServeReplica|ray::ProxyActor|lipstream.cli serve" | grep -v grep | cut -c1-60
    hogs=""
    for k in $(seq ${HOGS:-2}); do nice -n 10 python -c "while True: pass" & hogs="$hogs $!"; done
    PYTHONPATH=$src timeout 300 python -m lipstream.cli serve-bench --url http://127.0.0.1:$PORT --sessions ${NS:-1,1,1} \
      --seconds 12 --no-warmup -o "$W/report-$mode" > "$W/bench-$mode.txt" 2>&1
    echo "$mode serve-bench rc $?"
    [ -n "$hogs" ] && kill $hogs
    grep -E "^\| [0-9]" "$W/report-$mode/serve_bench.md"
    kill -TERM $S; wait $S
  done
  [ -n "${OLD:-}" ] && git worktree remove --force "$W-old"
}

ingress_cpu() {  # each serving process's CPU seconds so far
  local p n
  for p in $(pgrep -f "ray::ProxyActor|lipstream:front|bin/haproxy|lipstream:engine"); do
    n=$(tr '\0' ' ' < /proc/$p/cmdline | grep -oE "ray::ProxyActor|lipstream:front|haproxy|lipstream:engine" | head -1)
    echo "$n $(awk '{print ($14+$15)/100}' /proc/$p/stat)"
  done | awk '{s[$1]+=$2} END {for (k in s) printf "%s=%.2f  ", k, s[k]; print ""}'
}

stage_ingress() {
  local W=${W:-/tmp/fleet-ingress}; rm -rf "$W"; mkdir -p "$W"
  small_avatar "$W"
  local ingress
  for ingress in ray haproxy; do
    serve_cpu "$W/$ingress.log" "$W/avatars" --capacity-fps ${CAP:-120} --replicas 1 --ingress $ingress
    echo "$ingress: port $PORT served by $(ss -ltnp "sport = :$PORT" | grep -oE 'users:\(\("[^"]+"' | cut -d'"' -f2)"
    echo "  before: $(ingress_cpu)"
    timeout 300 python -m lipstream.cli serve-bench --url http://127.0.0.1:$PORT --sessions ${NS:-4,4} \
      --seconds 12 --no-warmup -o "$W/report-$ingress" > "$W/bench-$ingress.txt" 2>&1
    echo "  serve-bench rc $?"
    echo "  after:  $(ingress_cpu)"
    grep -E "^\| [0-9]" "$W/report-$ingress/serve_bench.md" | cut -d'|' -f2-9
    kill -TERM $S; wait $S
  done
}

[ $# -gt 0 ] || { sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2; }
for stage in "$@"; do
  case $stage in
  jobs|nice|ingress) stage_$stage ;;
  *) echo "unknown stage '$stage': jobs nice ingress"; exit 2 ;;
  esac
done
