#!/bin/bash
# The agent-stack adapters under load on an H200 (benchmarks/integrations.py), as docs/BENCHMARKS.md
# reports them. A device call in the repo root carries the wheels the image lacks (docs/NOTES.md
# lists them; 64 MiB travel per call, so one stack a call):
#   .whl-base (PyAV, diffusers, pydantic, ...) + .whl-pipecat (pipecat-ai, its .onnx models left out) or
#   .whl-livekit (livekit, livekit-agents without its sound resources, openai, ...); .whl-extra (Pillow,
#   aiohttp) only if the image lacks them.
#   STACKS=pipecat NS=8,16,20,24 SECONDS_=12 COMMIT=<sha> bash benchmarks/integrations_h200.sh
#   SERVE=1 STACKS=pipecat NS=8,16,20,24 ...: the engine in a `lipstream serve` of its own (carry .whl-serve,
#   which is .whl without dlib-bin, and .whl-pipecat:
#   fastapi, uvicorn and aiortc for the server and lipstream.client), the pipelines here over url=
# livekit-agents imports livekit-local-inference (35 MB) at import, so .whl-livekit does not travel
# with .whl-base: carry .whl-base + .whl-pipecat first, then .whl-livekit in a call right after (the
# machine stays warm 30 s; what the first installed in /tmp/site is still there). opentelemetry-api
# travels with each stack: a later --target install replaces the shared opentelemetry/ folder.
set -u
mkdir -p /tmp/site
# one pip call: with --target, a second call replaces the first's shared namespace folders (opentelemetry/)
# a wheel in two carried folders is installed once (pip refuses a double requirement)
whl=$(ls .whl/*.whl .whl-serve/*.whl .whl-base/*.whl .whl-pipecat/*.whl .whl-livekit/*.whl .whl-extra/*.whl 2>/dev/null | awk -F/ '!seen[$NF]++')
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site --upgrade $whl 2>&1 | grep -v "^$" | tail -3
export PYTHONPATH=/tmp/site:$PWD/src LIPSTREAM_COMMIT=${COMMIT:-?} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
python3 -m pip list 2>/dev/null > $OUT/pip_list.txt
python3 -c "import av, numpy, torch; print('av', av.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
[ "${STAGE:-bench}" = install ] && exit 0  # the first of two calls: wheels into /tmp/site only
STACKS=${STACKS:-pipecat}
for s in ${STACKS//,/ }; do
  python3 -c "import importlib; m = importlib.import_module('lipstream.bench.${s}_load'); print('$s load module imports')" 2>&1 | tail -2
done
python3 benchmarks/integrations.py --stacks $STACKS ${SERVE:+--serve} --sessions ${NS:-8,16,20,24} \
  --size ${SIZE:-1280x720} --seconds ${SECONDS_:-12} --out $OUT/integrations --work /tmp/lipstream-int-work 2>&1 | grep -v "| DEBUG" | tail -40
