#!/usr/bin/env bash
# Device calls that measure what the open issues ask for, one group per call (a device call has
# 10 minutes); every part runs under its own time limit, logs and JSON go under $OUT, and the
# tails of the logs are printed last.
#   bash benchmarks/suite.sh A      (carry .whl and .dswhl)
# A: checkpoint I/O (3B) + all four systems on the 1B shape, 16K/64K tokens/step
# B: all four systems on the 3B shape, 16K tokens/step + stock Trainer's longest sequence (3B)
# C: 7B shape at 256K tokens (long context) + 7B with automatic residency vs stock, 16K tokens/step
# D: the largest model this box trains (13B class) and a 70B-width model truncated to what fits
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
  part 200 io_3b python3 benchmarks/io_bench.py --shape llama-3.2-3b --dir /tmp/io --out "$OUT"
  part 360 bench_1b python3 benchmarks/bench.py --shape llama-3.2-1b --tokens 16384 65536 --clip 1.0 \
    --systems megatrain:0,megatrain:auto,stock,fsdp2,deepspeed --steps 4 --warmup 2 --out "$OUT" ;;
B)
  part 420 bench_3b python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 16384 --clip 1.0 \
    --systems megatrain:0,megatrain:auto,stock,fsdp2,deepspeed --steps 4 --warmup 2 --out "$OUT"
  part 150 long_stock_3b python3 benchmarks/long_context.py --shape llama-3.2-3b --seq --stock_from 16384 --out "$OUT" ;;
C)
  # TODO before running C: long_context.py and bench.py build an fp32 model on the host before the
  # store; at 7B that is 30 GB beside a ~100 GiB store, over this host's 125 GiB. Load from a disk
  # checkpoint instead (largest.py's write_random_checkpoint) for the 7B runs.
  part 300 long_7b python3 benchmarks/long_context.py --shape qwen2.5-7b --seq 262144 --out "$OUT"
  part 260 bench_7b python3 benchmarks/bench.py --shape qwen2.5-7b --tokens 16384 --clip 1.0 \
    --systems megatrain:auto,stock --stock_micro 4 --steps 5 --warmup 2 --out "$OUT" ;;
D)
  part 330 largest_13b python3 benchmarks/largest.py --shape llama-2-13b --steps 12 --out "$OUT"
  part 240 largest_70b python3 benchmarks/largest.py --shape llama-3.1-70b --layers 12 --steps 5 --out "$OUT" ;;
*) echo "unknown group $1 (A, B, C or D)"; exit 2 ;;
esac
for f in "${names[@]}"; do echo "== $f"; tail -n 14 "$OUT/$f.log"; done
