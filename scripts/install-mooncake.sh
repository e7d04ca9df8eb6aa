#!/usr/bin/env bash
# Installs the real Mooncake store (CPU-only wheel) so the `mooncake` L3 backend and its
# integration tests can run on machines without CUDA. Safe to run repeatedly.
#
# usage: scripts/install-mooncake.sh [VENV_DIR]   (default: .venv next to this script's repo)
set -euo pipefail

MOONCAKE_PKG="mooncake-transfer-engine-non-cuda==0.3.13.post1"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo_root/.venv}"
python="$venv/bin/python"

if [[ ! -x "$python" ]]; then
  echo "install-mooncake: no python at $python (pass the virtualenv directory)" >&2
  exit 2
fi

# The wheel links libibverbs.so.1 even for TCP; it is the only library a Debian base image lacks.
libs="$(ldconfig -p 2>/dev/null || true)"   # captured first: grep -q closing a pipe early trips pipefail
if [[ "$libs" != *"libibverbs.so.1 "* ]]; then
  if [[ "$(id -u)" -eq 0 ]]; then sudo_cmd=(); else sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq libibverbs1
fi

if "$python" -m pip show --quiet mooncake-transfer-engine-non-cuda 2>/dev/null \
   && [[ "$("$python" -m pip show mooncake-transfer-engine-non-cuda | awk '/^Version:/{print $2}')" == "0.3.13.post1" ]]; then
  echo "install-mooncake: $MOONCAKE_PKG already installed in $venv"
else
  "$python" -m pip install --quiet "$MOONCAKE_PKG"
fi

"$python" -c 'from mooncake.store import MooncakeDistributedStore' \
  && echo "install-mooncake: mooncake.store imports OK"
