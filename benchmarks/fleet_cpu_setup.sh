# Sourced by the fleet's CPU benchmarks (fleet_nice_cpu.sh, fleet_gil_cpu.sh, fleet_ingress_cpu.sh): the
# repository's venv, no keys, Ray without its usage report, and `small_avatar DIR`: a 320x180 avatar "small"
# of the tiny random networks under DIR/avatars (kept if there).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH=$PWD/.venv/bin:$PATH RAY_USAGE_STATS_ENABLED=0 LIPSTREAM_API_KEYS="" LIPSTREAM_SERVER=""
small_avatar() {
  [ -d "$1/avatars/small" ] && return 0
  mkdir -p "$1"
  python -c "
from pathlib import Path
from lipstream.fixtures.avatar import tracked_avatar
from lipstream.models import load_musetalk
m = load_musetalk(random_weights=True, size='tiny', device='cpu', seed=0)
tracked_avatar(Path('$1'), 'small', m.vae, m.fingerprints['vae'], width=320, height=180, seed=0)
" > /dev/null 2>&1 || { echo "the avatar failed"; exit 1; }
}
