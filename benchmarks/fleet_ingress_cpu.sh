#!/bin/bash
# Issue 26 on a CPU: what the fleet's ingress costs. `lipstream serve --replicas 1` behind Ray Serve's proxy, then
# behind HAProxy (`--ingress haproxy`), each under serve-bench's rows of NS sessions on a 320x180 avatar (tiny
# random networks; CAP frames/s admitted, more than 2 cores keep up with: the sockets' messages are the
# load looked at, not the frames). Prints the CPU seconds of Ray's proxy, HAProxy, the front and the engine
# over the rows (/proc, each process's user + system time) and the rows.
#   CAP=120 NS=4,4 bash benchmarks/fleet_ingress_cpu.sh
set -u
source "$(dirname "$0")/fleet_cpu_setup.sh"
W=${W:-/tmp/fleet-ingress}; rm -rf $W; mkdir -p $W
small_avatar $W
cpu() {  # each serving process's CPU seconds so far
  for p in $(pgrep -f "ray::ProxyActor|lipstream:front|bin/haproxy|lipstream:engine"); do
    n=$(tr '\0' ' ' < /proc/$p/cmdline | grep -oE "ray::ProxyActor|lipstream:front|haproxy|lipstream:engine" | head -1)
    echo "$n $(awk '{print ($14+$15)/100}' /proc/$p/stat)"
  done | awk '{s[$1]+=$2} END {for (k in s) printf "%s=%.2f  ", k, s[k]; print ""}'
}
for ingress in ray haproxy; do
  python -m lipstream.cli serve --avatars $W/avatars --data $W/data-$ingress --random-weights --random-size tiny \
    --device cpu --port 8765 --live-preset cpu --capacity-fps ${CAP:-120} --replicas 1 --ingress $ingress \
    > $W/$ingress.log 2>&1 &
  S=$!
  for i in $(seq 400); do curl -sf http://127.0.0.1:8765/readyz >/dev/null && break; sleep 0.5; done
  echo "$ingress: ready; port 8765 served by $(ss -ltnp "sport = :8765" | grep -oE 'users:\(\("[^"]+"' | cut -d'"' -f2)"
  echo "  before: $(cpu)"
  timeout 300 python -m lipstream.cli serve-bench --url http://127.0.0.1:8765 --sessions ${NS:-4,4} \
    --seconds 12 --no-warmup -o $W/report-$ingress > $W/bench-$ingress.txt 2>&1
  echo "  serve-bench rc $?"
  echo "  after:  $(cpu)"
  grep -E "^\| [0-9]" $W/report-$ingress/serve_bench.md | cut -d'|' -f2-9
  kill -TERM $S; wait $S
done
