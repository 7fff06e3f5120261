#!/bin/bash
# Issue 26 on a CPU: does a fleet's engine lose the CPU to the host's other processes? Plain `lipstream serve`,
# `--replicas 1` at the commit given as OLD (Ray's workers at nice +15) and `--replicas 1` of this tree (the
# replicas at the raylet's priority), each under the same load: HOGS busy processes at nice 10 (as serve-bench's
# clients are) beside serve-bench's rows of one session on a 320x180 avatar (tiny random networks, capacity 30
# frames/s as in tests/test_serve_fleet.py).
#   OLD=de06db2 HOGS=2 NS=1,1,1 bash benchmarks/fleet_nice_cpu.sh
set -u
source "$(dirname "$0")/fleet_cpu_setup.sh"
W=${W:-/tmp/fleet-nice}; rm -rf $W; mkdir -p $W
small_avatar $W
[ -n "${OLD:-}" ] && { git worktree remove --force $W-old 2>/dev/null; git worktree add -q --detach $W-old $OLD; }
for mode in plain old new; do
  [ $mode = old ] && [ -z "${OLD:-}" ] && continue
  src=$PWD/src; extra="--replicas 1"
  [ $mode = plain ] && extra=""
  [ $mode = old ] && src=$W-old/src
  PYTHONPATH=$src python -m lipstream.cli serve --avatars $W/avatars --data $W/data-$mode --random-weights \
    --random-size tiny --device cpu --port 8765 --live-preset cpu --capacity-fps 30 $extra > $W/$mode.log 2>&1 &
  S=$!
  t=$(date +%s.%N)
  for i in $(seq 400); do curl -sf http://127.0.0.1:8765/readyz >/dev/null && break; sleep 0.5; done
  echo "$mode ready after $(python -c "import time;print(round(time.time()-$t,1))") s"
  ps -eo ni,args | grep -E "ray::ServeReplica|ray::ProxyActor|lipstream.cli serve" | grep -v grep | cut -c1-60
  hogs=""
  for k in $(seq ${HOGS:-2}); do nice -n 10 python -c "while True: pass" & hogs="$hogs $!"; done
  PYTHONPATH=$src timeout 300 python -m lipstream.cli serve-bench --url http://127.0.0.1:8765 --sessions ${NS:-1,1,1} \
    --seconds 12 --no-warmup -o $W/report-$mode > $W/bench-$mode.txt 2>&1
  echo "$mode serve-bench rc $?"
  [ -n "$hogs" ] && kill $hogs
  grep -E "^\| [0-9]" $W/report-$mode/serve_bench.md
  kill -TERM $S; wait $S
done
[ -n "${OLD:-}" ] && git worktree remove --force $W-old
