#!/bin/bash
# Issue 26 on a CPU: plain `lipstream serve` against `--replicas 1` (tiny random networks, the demo avatar of `make demo`),
# four `render --server` jobs of 3 s of speech each: client wall, and queued/ran from the jobs' own timestamps.
#   bash benchmarks/fleet_jobs_cpu.sh       (MODES=replicas1 for one side)
set -u
cd "$(dirname "$0")/.."
export PATH=$PWD/.venv/bin:$PATH RAY_USAGE_STATS_ENABLED=0 LIPSTREAM_API_KEYS="" LIPSTREAM_SERVER=""
W=${W:-/tmp/fleet-jobs}; mkdir -p $W; W=$W python - <<'PY'
import os
from lipstream.fixtures import speech_like, write_audio
write_audio(os.environ["W"] + "/job.wav", speech_like(3.0, 16000, seed=7), 16000)
PY
for mode in ${MODES:-plain replicas1}; do
  extra=""; [ $mode = replicas1 ] && extra="--replicas 1"
  rm -rf $W/data-$mode
  lipstream serve --avatars demo-out/avatars --data $W/data-$mode --random-weights --random-size tiny --device cpu --port 8765 --live-preset cpu $extra > $W/$mode.log 2>&1 &
  S=$!
  t=$(date +%s.%N)
  for i in $(seq 300); do curl -sf http://127.0.0.1:8765/readyz >/dev/null && break; sleep 0.5; done
  echo "$mode ready after $(python -c "import time;print(round(time.time()-$t,1))") s"
  for k in 1 2 3 4; do
    t=$(date +%s.%N)
    lipstream render --server http://127.0.0.1:8765 --avatar anchor-360p --audio $W/job.wav -o $W/$mode-$k.mp4 > $W/$mode-$k.txt 2>&1
    echo "$mode job $k: rc $? wall $(python -c "import time;print(round(time.time()-$t,2))") s"
  done
  curl -s http://127.0.0.1:8765/v1/jobs | python -c "
import json,sys
d=json.load(sys.stdin); jobs=d['jobs'] if isinstance(d,dict) else d
for j in sorted(jobs, key=lambda j: j['created_at']):
    print('  queued %.3f s, ran %.3f s' % (j['started_at']-j['created_at'], j['finished_at']-j['started_at']))
"
  kill -INT $S; wait $S
done
