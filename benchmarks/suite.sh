#!/usr/bin/env bash
# Device calls that measure what the open issues ask for, one group per call (a device call has
# 10 minutes); every part runs under its own time limit, logs and JSON go under $OUT, and the
# tails of the logs are printed last.
#   bash benchmarks/suite.sh A      (carry .whl and .dswhl)
# A: the GPU tests + all-streamed vs stock on the 3B shape (16K and 64K tokens/step, clip 1 and 0)
# B: the largest model this box trains (13B class) + a 70B-width model truncated to what fits
# C: the 7B shape (loaded from disk), default residency vs stock, 16K and 64K tokens/step
# D: stock Trainer's longest sequence (3B) + the 7B shape at 512K tokens in one sequence (the planner
#    is expected to refuse) and at 256K
# E: the 3B shape at 512K tokens, full depth (about 8 minutes of attention)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if ls .dswhl/*.whl >/dev/null 2>&1; then  # deepspeed: visible to bench.py's deepspeed process only
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/dssite .dswhl/*.whl
  export DS_SITE=/tmp/dssite
fi
names=()
part() {  # part SECONDS NAME command...: run, keep its log, never stop the suite
  local limit=$1 name=$2; shift 2
  names+=("$name")
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "   exit $?"
}
case "${1:-A}" in
A)
  part 150 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
  part 420 bench_3b python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 16384 65536 --clip 1.0 0.0 \
    --systems megatrain:0,stock --steps 6 --warmup 2 --out "$OUT" ;;
B)
  part 260 largest_13b python3 benchmarks/largest.py --shape llama-2-13b --steps 10 --warmup 2 --out "$OUT"
  part 280 largest_70b python3 benchmarks/largest.py --shape llama-3.1-70b --layers 11 --steps 5 --warmup 2 \
    --out "$OUT"
  part 30 projection python3 benchmarks/project.py "$OUT/largest_llama-3.1-70b_11.json" --tokens 16384 65536 131072 ;;
C)
  part 560 bench_7b python3 benchmarks/bench.py --shape qwen2.5-7b --tokens 16384 65536 --clip 1.0 \
    --systems megatrain:auto,stock --stock_micro 2 --steps 5 --warmup 2 --from_disk /tmp/ckpt --out "$OUT" ;;
D)
  part 240 long_stock_3b python3 benchmarks/long_context.py --shape llama-3.2-3b --seq --stock_from 16384 \
    --out "$OUT"
  part 330 long_7b python3 benchmarks/long_context.py --shape qwen2.5-7b --seq 524288 262144 --out "$OUT" ;;
E)
  part 580 long_3b python3 benchmarks/long_context.py --shape llama-3.2-3b --seq 524288 --out "$OUT" ;;
*) echo "unknown group $1 (A to E)"; exit 2 ;;
esac
for f in "${names[@]}"; do echo "== $f"; tail -n 14 "$OUT/$f.log"; done
