#!/bin/bash
# The agent-stack adapters under load on an H200 (benchmarks/integrations.py), as docs/BENCHMARKS.md
# reports them. A device call in the repo root carries the wheels the image lacks: .whl (lipstream's
# own dependencies) and .whl-int (pipecat-ai, livekit-agents and theirs; docs/NOTES.md lists them).
# 64 MiB travel per call, so two calls back to back (STAGE=install with .whl, then STAGE=bench with
# .whl-int) share /tmp/site while the machine stays warm.
#   STAGE=install bash benchmarks/integrations_h200.sh     (carry .whl)
#   STAGE=bench STACKS=pipecat,livekit NS=8,16,20,24 SECONDS_=12 COMMIT=<sha> bash benchmarks/integrations_h200.sh   (carry .whl-int)
set -u
mkdir -p /tmp/site
for d in .whl .whl-int; do
  [ -d $d ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site --upgrade $d/*.whl 2>&1 | grep -v "^$" | grep -v "already exists" | tail -3
done
export PYTHONPATH=/tmp/site:$PWD/src LIPSTREAM_COMMIT=${COMMIT:-?} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
python3 -m pip list 2>/dev/null > $OUT/pip_list.txt
python3 -c "import av, diffusers, numpy, torch; print('av', av.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
[ "${STAGE:-bench}" = install ] && exit 0
python3 -c "import pipecat, livekit.agents, livekit.rtc; print('pipecat', pipecat.__version__ if hasattr(pipecat, '__version__') else '?', 'livekit-agents', livekit.agents.__version__)" 2>&1 | tail -2
python3 benchmarks/integrations.py --stacks ${STACKS:-pipecat,livekit} --sessions ${NS:-8,16,20,24} \
  --size ${SIZE:-1280x720} --seconds ${SECONDS_:-12} --out $OUT/integrations 2>&1 | grep -v "^20..-..-.. ..:..:..\.... | DEBUG" | tail -40
