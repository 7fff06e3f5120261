#!/bin/bash
# Issue 28 on the H200: what a user waits for, commands as typed, fresh processes, default flags.
# Wheels: `bash benchmarks/h200_wheels.sh` here first (the image lacks PyAV, the server's stack...).
#   STAGE=one (carry .whl): the AOT loader check (benchmarks/aot_loader.py), the one-shot renders
#     (benchmarks/user_render.py: compile, nothing cached, warm, exact, --no-compile), `lipstream serve`
#     from process start to /readyz 200 cold and warm, and `lipstream render --server` against it.
#   STAGE=two (carry .whl-ray1 and .h200in, the machine still warm from STAGE=one): Ray's first half
#     staged for benchmarks/fleet_h200.sh; with AOT=1 `lipstream warmup` and the renders on the compiled
#     engine; tests/test_networks.py on the GPU; the GPU core (benchmarks/core_variants.py).
#   COMMIT=<sha> STAGE=one bash benchmarks/oneshot_h200.sh
set -u
W=$PWD/.h200
mkdir -p $W
export PYTHONPATH=/tmp/site:/tmp/site-ray:$PWD/src PYTHONUNBUFFERED=1 LIPSTREAM_COMMIT=${COMMIT:-?} \
  TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor RAY_USAGE_STATS_ENABLED=0
secs() { python3 -c "import time; print(round(time.time() - $1, 1))"; }
AUDIO=$W/ur/work/speech.wav

wait_ready() {  # start time, pid, limit s: process start -> /readyz 200
  python3 - "$@" <<'PY'
import os, sys, time, urllib.request
t0, pid, limit = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
while time.time() - t0 < limit:
    try:
        if urllib.request.urlopen("http://127.0.0.1:8000/readyz", timeout=2).status == 200:
            print(f"ready {time.time() - t0:.1f} s after the process started"); sys.exit(0)
    except Exception:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        print("the server died"); sys.exit(1)
    time.sleep(0.2)
print(f"not ready after {limit} s"); sys.exit(1)
PY
}

serve_row() {  # name, limit s
  t0=$(date +%s.%N)
  python3 -m lipstream.cli serve --avatars $W/ur/work/avatars --random-weights --port 8000 --data $W/data \
    > $OUT/serve_$1.log 2>&1 &
  SPID=$!
  local said; said=$(wait_ready $t0 $SPID $2); local rc=$?
  echo "serve $1: $said"
  grep -m1 'ready' $OUT/serve_$1.log | cut -c1-700
  [ $rc = 0 ] || tail -5 $OUT/serve_$1.log
  return $rc
}

serve_stop() {
  t0=$(date +%s.%N); kill -TERM $SPID; wait $SPID; echo "serve exit $? after SIGTERM, $(secs $t0) s"
}

if [ "${STAGE:-one}" = one ]; then
  t=$(date +%s.%N)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | grep -v "^$" | tail -2
  echo "wheels installed in $(secs $t) s"
  { g++ --version | head -1; ls -la /usr/lib/gcc/x86_64-linux-gnu/*/libstdc++* ; ldconfig -p | grep stdc++;
    python3 -c "import torch, grpc, google.protobuf as p, av, fastapi; print('torch', torch.__version__, 'cxx11 abi', torch._C._GLIBCXX_USE_CXX11_ABI, 'grpc', grpc.__version__, 'protobuf', p.__version__, 'av', av.__version__, 'fastapi', fastapi.__version__)";
    nproc; } > $OUT/facts.txt 2>&1
  tail -3 $OUT/facts.txt
  t=$(date +%s.%N)
  timeout 200 python3 benchmarks/aot_loader.py build cuda default stdcxx > $OUT/aot_loader.json 2> $OUT/aot_loader.err
  echo "aot_loader rc $? in $(secs $t) s"
  python3 -c "import json; r = json.load(open('$OUT/aot_loader.json')); [print(k, v.get('load_rc'), v.get('build_s'), v.get('load_output', v.get('build_error', ''))[-160:], json.dumps(v.get('wrapper'))[:300]) for k, v in r.items()]"
  t=$(date +%s.%N)
  timeout 250 python3 benchmarks/user_render.py --out $W/ur --track-truth --runs 2 --no-warmup > $OUT/user_render.txt 2>&1
  echo "user_render rc $? in $(secs $t) s"; tail -9 $OUT/user_render.txt; cp $W/ur/user_render.json $OUT/ 2>/dev/null
  serve_row cold 230 && {
    for k in 1 2; do
      t=$(date +%s.%N)
      python3 -m lipstream.cli render --server http://127.0.0.1:8000 --avatar anchor --audio $AUDIO -o $W/srv$k.mp4 \
        >> $OUT/server_render.txt 2>&1
      echo "render --server rc $? process wall $(secs $t) s"; tail -2 $OUT/server_render.txt
    done
    serve_stop
    serve_row warm 120 && serve_stop
  }
fi

if [ "${STAGE:-one}" = two ]; then
  mkdir -p /tmp/raywheel && cp .whl-ray1/ray.part1 /tmp/raywheel/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-ray \
    .whl-ray1/*.whl 2>&1 | grep -v "^$" | tail -2
  echo "Ray's dependencies installed, its first half staged"
  if [ -n "${AOT:-}" ]; then
    t=$(date +%s.%N)
    (cd $W/ur/work && LIPSTREAM_CACHE=$W/ur/cache timeout 330 python3 -m lipstream.cli warmup --random-weights) \
      > $OUT/warmup.txt 2>&1
    echo "warmup rc $? in $(secs $t) s"; tail -6 $OUT/warmup.txt
    t=$(date +%s.%N)
    timeout 160 python3 benchmarks/user_render.py --out $W/ur --keep-cache --runs 2 --no-warmup \
      > $OUT/user_render_compiled.txt 2>&1
    echo "user_render (compiled) rc $? in $(secs $t) s"; tail -9 $OUT/user_render_compiled.txt
    cp $W/ur/user_render.json $OUT/user_render_compiled.json 2>/dev/null
  fi
  t=$(date +%s.%N)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_networks.py > $OUT/test_networks.txt 2>&1
  echo "tests/test_networks.py rc $? in $(secs $t) s"; tail -3 $OUT/test_networks.txt
  t=$(date +%s.%N)
  timeout ${CORE_T:-200} python3 benchmarks/core_variants.py --track .h200in/anchor.track.json --out $OUT/core \
    --variants transpose:auto > $OUT/core_variants.txt 2>&1
  echo "core_variants rc $? in $(secs $t) s"; tail -6 $OUT/core_variants.txt
fi
find $OUT -size +15M -delete
