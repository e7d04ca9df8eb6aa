#!/usr/bin/env bash
# The local demo. Sets up what is missing (idempotent), then runs scripts/demo.py:
# a local control plane with simulated GPU nodes, the operator installed with helm,
# a bundled-runtime fleet whose L1 is smaller than its traffic, returning conversations
# served from L2, a live L3 backend swap under load, and a pod served from the shared L3.
#   scripts/demo.sh          run it (warm: a few minutes)
#   scripts/demo.sh down     stop the demo cluster and remove its network namespace
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HICACHE_VENV:-.venv}"
DEMO_DIR="${HICACHE_DEMO_DIR:-/tmp/hicache-demo}"
if [[ "${1:-}" == "down" ]]; then
  exec "$VENV/bin/python" -m localcluster down --workdir "$DEMO_DIR"
fi
bash scripts/setup.sh
exec "$VENV/bin/python" scripts/demo.py
