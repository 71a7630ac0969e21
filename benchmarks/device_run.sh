#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests, then the benchmark.
# Usage (on the device, from the repo root): bash benchmarks/device_run.sh [bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# DeepSpeed and its run-time deps (.dswhl, CPython 3.12 manylinux wheels) go to a folder of their own that
# bench.py puts on the path of its deepspeed process only: transformers imports deepspeed whenever it can
# find it, which the GPU tests and the other systems must not see.
if ls .dswhl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dssite .dswhl/*.whl
  export DS_SITE=/tmp/dssite
fi
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
# the versions of this call (bench.py's JSON states them too); see benchmarks/versions.py for the commit
timeout 120 python3 benchmarks/versions.py --json "$OUT/versions.json" || echo "VERSIONS not recorded (exit $?)"
free -g | head -2
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/gpu/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [ "$#" -gt 0 ]; then
  python3 benchmarks/bench.py --out "$OUT" "$@" 2>&1 | tail -30
fi
