#!/bin/bash
# Issue 28's fixed costs on the H200, piece by piece (benchmarks/startup_probe.py), then the monologue's
# renders on the uncompiled engine (no packages: no warmup's minutes), the last one under py-spy (every
# thread and the encoder processes, native frames, idle samples kept): where the render's wall goes.
# Carry .whl and .whl-diag (py-spy's wheel).
#   COMMIT=<sha> bash benchmarks/startup_h200.sh
set -u
W=$PWD/.h200
mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  .whl-diag/*.whl 2>&1 | grep -v "^$" | tail -2
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 LIPSTREAM_COMMIT=${COMMIT:-?} PATH=/tmp/site/bin:$PATH
timeout ${PROBE_T:-200} python3 benchmarks/startup_probe.py --runs ${RUNS:-2} > $OUT/probe.jsonl 2> $OUT/probe.err
echo "probe rc $?"; cat $OUT/probe.jsonl | cut -c1-400; tail -3 $OUT/probe.err
timeout ${UR_T:-200} python3 benchmarks/user_render.py --out $W/ur --track-truth --runs 0 --no-exact --no-warmup \
  > $OUT/user_render.txt 2>&1
echo "user_render rc $?"; grep -E "^(compile|\{)" $OUT/user_render.txt | cut -c1-300
grep -A16 "start-up and render" $OUT/user_render.txt | tail -17
cd $W/ur/work
export LIPSTREAM_CACHE=$W/ur/cache TORCHINDUCTOR_CACHE_DIR=$W/ur/cache/inductor COLUMNS=200
t=$(date +%s.%N)
timeout 60 py-spy record --idle --threads --subprocesses --native -r 200 --format speedscope -o $OUT/render_pyspy.json -- \
  python3 -m lipstream render --avatar anchor --audio speech.wav -o o_spy.mp4 --random-weights --timings \
  > $OUT/spy_render.txt 2>&1
echo "py-spy render rc $? in $(python3 -c "import time; print(round(time.time() - $t, 1))") s"
tail -22 $OUT/spy_render.txt | cut -c1-220
ls -la $OUT
find $OUT -size +15M -delete
