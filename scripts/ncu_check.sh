#!/usr/bin/env bash
# The GPU check of `profile --ncu` (issue 17) on PLAN: decode_1 at context 128 and decode_64 at context 1024 under
# Nsight Compute with the bounded default (--layers 2: layers 0-1 plus embedding and head; DRAM bytes and time, one
# replay pass), then decode_1 with --all-metrics --layers 1 (DRAM %, SM %, occupancy: more passes) to measure what
# they cost. Per run: report OUTDIR/NAME.ncu-rep, table OUTDIR/NAME.txt, OUTDIR/NAME.stderr; printed (and in
# OUTDIR/summary.txt): exit status, seconds, the agreement line (ncu DRAM GB/s vs event-timed GB/s) and the NVTX
# line. Extra arguments go to every `profile` call. Needs ncu on PATH and the package importable (PYTHONPATH).
# Exit status 0 when the two default runs finished.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 PLAN OUTDIR [profile options]" >&2; exit 2; }
plan=$1 out=$2
shift 2
mkdir -p "$out"
command -v ncu >/dev/null || { echo "ncu is not on PATH (export PATH=/usr/local/cuda/bin:\$PATH)" >&2; exit 2; }
ncu --version | tail -n 1 | tee "$out/summary.txt"
rc=0

check() {  # NAME LIMIT_S BUCKET CONTEXT [profile options]
  local name=$1 limit=$2 bucket=$3 ctx=$4
  shift 4
  local t0=$(date +%s)
  timeout "$limit" python3 -m xserv_aot.cli profile "$plan" --bucket "$bucket" --context "$ctx" --ncu \
    --out "$out/$name" "$@" >"$out/$name.txt" 2>"$out/$name.stderr"
  local status=$?
  echo "$name ($bucket context $ctx $*): exit $status in $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.txt"
  [ $status -eq 0 ] || tail -n 5 "$out/$name.stderr" | tee -a "$out/summary.txt"
  grep -E '^(agreement|nvtx):' "$out/$name.txt" | sed "s/^/  /" | tee -a "$out/summary.txt"
  return $status
}

check decode_1 200 decode_1 128 "$@" || rc=1
check decode_64 200 decode_64 1024 "$@" || rc=1
check decode_1_all_metrics 120 decode_1 128 --all-metrics --layers 1 "$@"
exit $rc
