#!/usr/bin/env bash
# Serving benchmark on the GPU machine: `xserv-aot serve PLAN` (CUDA backend, engine core in its own process),
# wait for /health, run `xserv-aot bench-serve` scenarios against it on loopback, SIGTERM the server.
# Usage: [BACKEND=cpu] scripts/serve_bench.sh PLAN OUTDIR [scenario ...]   (PLAN holds tokenizer.json; default:
# c1 c64 c256 c64_1k; also: smoke = 4 tiny requests, hostile = scripts/hostile_prompts.py)
# Scenarios (vLLM `bench serve` flags; ignore_eos so lengths are exact):
#   c1      1 client, 128-token prompts, 128 output tokens, 16 requests
#   c64     64 clients, ~100-token prompts, 256 output tokens, 256 requests
#   c256    256 clients, ~100-token prompts, 256 output tokens, 512 requests
#   c64_1k  64 clients, ~1000-token prompts, 128 output tokens, 256 requests
set -uo pipefail
plan=$1 out=$2
shift 2
scenarios=("${@:-c1 c64 c256 c64_1k}")
mkdir -p "$out"
python3 -m xserv_aot.cli serve "$plan" --host 127.0.0.1 --port 8000 --backend "${BACKEND:-cuda}" > "$out/server.log" 2>&1 &
pid=$!
up=0
for _ in $(seq 1 240); do
  if python3 -c "import httpx,sys; sys.exit(0 if httpx.get('http://127.0.0.1:8000/health', timeout=2).status_code == 200 else 1)" 2>/dev/null; then
    up=1; break
  fi
  kill -0 $pid 2>/dev/null || break
  sleep 1
done
if [ $up != 1 ]; then echo "server did not come up"; tail -20 "$out/server.log"; kill -9 $pid 2>/dev/null; exit 1; fi
run() {
  local name=$1; shift
  timeout 240 python3 -m xserv_aot.bench.serve --base-url http://127.0.0.1:8000 --tokenizer "$plan" --seed 0 \
    --dataset-name random --disable-tqdm --save-result "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  echo "== $name (exit $?)"; grep -iE "throughput|TTFT|TPOT|ITL|requests|error|warning" "$out/$name.txt" | head -20
}
for s in ${scenarios[*]}; do
  case $s in
    smoke) run smoke --random-input-len 16 --random-output-len 8 --num-prompts 4 --max-concurrency 2 ;;
    c1) run c1 --random-input-len 128 --random-output-len 128 --num-prompts 16 --max-concurrency 1 ;;
    c64) run c64 --random-input-len 100 --random-output-len 256 --num-prompts 256 --max-concurrency 64 ;;
    c256) run c256 --random-input-len 100 --random-output-len 256 --num-prompts 512 --max-concurrency 256 ;;
    c64_1k) run c64_1k --random-input-len 1000 --random-output-len 128 --num-prompts 256 --max-concurrency 64 ;;
    hostile) timeout 120 python3 scripts/hostile_prompts.py --base-url http://127.0.0.1:8000 --out "$out/hostile.json"
             echo "== hostile (exit $?)"; cat "$out/hostile.json" 2>/dev/null ;;
    *) echo "unknown scenario $s" ;;
  esac
done
kill -TERM $pid
wait $pid
echo "server exit $?"
tail -5 "$out/server.log"
