#!/usr/bin/env bash
# Run the GPU tests (pytest -m gpu) on the device machine. Logs go to $OUT (or /tmp/xserv-gpu-out).
# Default: tests/test_cuda_*.py (the server tests need packages the device lacks). Carried extras, when present:
# .whl/*.whl (missing Python packages), .xcache/ (prebuilt NVRTC cubins). Extra arguments go to pytest, e.g.
# `tests/test_cuda_cutlass.py --gemm-lib PLAN/kernels/libxserv_gemm.so` where nvidia-cutlass is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- tests/test_cuda_*.py
OUT=${OUT:-/tmp/xserv-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d .xcache ] && export XSERV_AOT_CACHE=$PWD/.xcache
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cuda.bindings.nvrtc as n, cuda.core, cuda.bindings; print('nvrtc', n.nvrtcVersion()[1:], 'cuda.core', cuda.core.__version__, 'cuda.bindings', cuda.bindings.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider -rA -q "$@" 2>&1 | tee "$OUT/gpu_tests.log"
