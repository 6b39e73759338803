#!/usr/bin/env bash
# Create .venv and install xserv-aot with its CUDA build tools (and test tools with --test). Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
extras="cuda"
[ "${1:-}" = "--test" ] && extras="cuda,test"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${extras}]"
