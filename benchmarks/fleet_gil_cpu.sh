#!/bin/bash
# Issue 26 on a CPU: who holds the engine process's GIL under one live session, plain `lipstream serve` against
# `--replicas 1` (the replica actor). One serve-bench row of 30 s (one session on a 320x180 avatar, tiny random
# networks, capacity 30 frames/s); 14 s in, 10 s of `py-spy record --gil --threads` of the engine's process;
# then the samples by thread and by the deepest lipstream/ray/asyncio frame.
#   bash benchmarks/fleet_gil_cpu.sh            # MODES="plain new" (new: --replicas 1)
set -u
source "$(dirname "$0")/fleet_cpu_setup.sh"
W=${W:-/tmp/fleet-gil}; mkdir -p $W
small_avatar $W
for mode in ${MODES:-plain new}; do
  extra="--replicas 1"; [ $mode = plain ] && extra=""
  rm -rf $W/data-$mode
  python -m lipstream.cli serve --avatars $W/avatars --data $W/data-$mode --random-weights --random-size tiny \
    --device cpu --port 8765 --live-preset cpu --capacity-fps 30 $extra > $W/$mode.log 2>&1 &
  S=$!
  for i in $(seq 400); do curl -sf http://127.0.0.1:8765/readyz >/dev/null && break; sleep 0.5; done
  pid=$S; [ $mode != plain ] && pid=$(pgrep -f "ServeReplica:lipstream:engine" | head -1)
  python -m lipstream.cli serve-bench --url http://127.0.0.1:8765 --sessions 1 --seconds 30 --no-warmup \
    -o $W/report-$mode > $W/bench-$mode.txt 2>&1 &
  B=$!
  sleep 14
  py-spy record --gil --threads -r 100 -d 10 --nonblocking --format raw -o $W/$mode-gil.txt -p $pid > /dev/null 2>&1
  wait $B
  echo "$mode:"; grep -E "^\| [0-9]" $W/report-$mode/serve_bench.md
  kill -TERM $S; wait $S
  python - "$W/$mode-gil.txt" <<'PY'
import collections, sys
threads, frames = collections.Counter(), collections.Counter()
for line in open(sys.argv[1]).read().splitlines():
    stack, _, n = line.rpartition(" ")
    parts = stack.split(";")
    threads[parts[0][:60]] += int(n)
    ours = [f for f in parts if any(k in f for k in ("lipstream", "ray/", "asyncio", "uvicorn", "aiortc"))]
    frames[(parts[0][:30], (ours[-1] if ours else parts[-1])[:100])] += int(n)
print(f"  GIL samples: {sum(threads.values())}")
for k, v in threads.most_common(8):
    print(f"  {v:5d}  {k}")
for (t, f), v in frames.most_common(12):
    print(f"  {v:5d}  {t}  {f}")
PY
done
