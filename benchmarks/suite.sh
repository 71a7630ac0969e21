#!/usr/bin/env bash
# One device call that measures what the open issues ask for, each part under its own time limit
# (a device call has 10 minutes), logs and JSON under $OUT, the tables printed last.
#   bash benchmarks/suite.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
part() {  # part SECONDS NAME command...: run, keep its log, never stop the suite
  local limit=$1 name=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "   exit $?"
}
part 40 gpu_tests python3 -m pytest -q -m gpu tests/test_gpu.py -k "activation_offload"
part 90 io_3b python3 benchmarks/io_bench.py --shape llama-3.2-3b --dir /tmp/io --out "$OUT"
part 110 bench_1b python3 benchmarks/bench.py --shape llama-3.2-1b --tokens 16384 --clip 1.0 0.0 \
  --systems megatrain:0,stock --steps 4 --warmup 2 --out "$OUT"
part 100 long_3b python3 benchmarks/long_context.py --shape llama-3.2-3b --layers 4 --seq 524288 --out "$OUT"
for f in gpu_tests io_3b bench_1b long_3b; do echo "== $f"; tail -n 14 "$OUT/$f.log"; done
