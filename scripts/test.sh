#!/usr/bin/env bash
# Install the project with its test tools into .venv, fetch the offline assets, run the CPU test suite.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh --test
PYTHON=.venv/bin/python bash scripts/fetch_assets.sh >/dev/null
exec .venv/bin/python -m pytest -q "$@"
