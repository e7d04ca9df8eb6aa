#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite: unit, integration and e2e on the
# local control plane. Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${HICACHE_VENV:-.venv}"
echo
echo "==> pytest"
exec "$VENV/bin/python" -m pytest "${@:-tests}"
