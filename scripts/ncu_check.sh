#!/usr/bin/env bash
# The GPU check of `profile --ncu` (issue 17): decode_1 at context 128 and decode_64 at context 1024 of PLAN under
# Nsight Compute with the bounded default (--layers 2: layers 0-1 plus embedding and head), each report
# (OUTDIR/BUCKET.ncu-rep), table (OUTDIR/BUCKET.txt) and stderr kept; prints each run's exit status and time and
# its agreement (ncu DRAM GB/s vs event-timed GB/s) and NVTX lines. Extra arguments go to every `profile` call
# (e.g. --layers 1, --kernel REGEX). Needs ncu on PATH and the package importable (PYTHONPATH); a run stops at
# 280 s. Exit status 0 when both runs finished.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 PLAN OUTDIR [profile options]" >&2; exit 2; }
plan=$1 out=$2
shift 2
mkdir -p "$out"
command -v ncu >/dev/null || { echo "ncu is not on PATH (export PATH=/usr/local/cuda/bin:\$PATH)" >&2; exit 2; }
ncu --version | tail -1 | tee "$out/summary.txt"
rc=0
for run in decode_1:128 decode_64:1024; do
  bucket=${run%:*} ctx=${run#*:}
  t0=$(date +%s)
  timeout 280 python3 -m xserv_aot.cli profile "$plan" --bucket "$bucket" --context "$ctx" --ncu \
    --out "$out/$bucket" "$@" >"$out/$bucket.txt" 2>"$out/$bucket.stderr"
  status=$?
  echo "$bucket context $ctx: exit $status in $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.txt"
  if [ $status -ne 0 ]; then
    rc=1
    tail -n 5 "$out/$bucket.stderr" | tee -a "$out/summary.txt"
  fi
  grep -E '^(agreement|nvtx):' "$out/$bucket.txt" | sed "s/^/  /" | tee -a "$out/summary.txt"
done
exit $rc
