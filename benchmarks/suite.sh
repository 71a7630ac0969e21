#!/usr/bin/env bash
# Device calls that measure what the open issues ask for, one group per call (a device call has
# 10 minutes); every part runs under its own time limit, logs and JSON go under $OUT, and the
# tails of the logs are printed last.
#   bash benchmarks/suite.sh A      (carry .whl and .dswhl)
# A: the GPU tests + the host AdamW's threads and span sizes + all-streamed vs stock, 3B shape
# B: GPU peak flat in depth (1B width, 8/16/32 layers, all streamed) + default residency vs stock, 3B, 64K
# C: the offload systems at 64K tokens/step beside the default (3B; carry .dswhl too; stock: B)
# D: the largest model this box trains (13B class) again, with per-step times and allocator retries
# E: the 3B shape at 512K tokens, full depth (about 8 minutes of attention)
# F: long rows of packed documents: the GPU test of document-wise attention + the 3B shape at 512K
#    tokens packed from 32K-token documents, full depth
# G: a change checked before and after: every gpu-marked test, then the 3B shape at 16K tokens/step,
#    stock vs default vs all-streamed, this code beside the code before the change (a copy of that
#    commit in .old: `git archive C hf_megatrain benchmarks` extracted there, and `echo C >
#    .old/COMMIT` so the record names it; carried). Issue 16 used C=3ecacb0, issue 17 C=f76ab9b.
#    `G tests` or `G bench` runs one half
# H: issue 18's families: every gpu-marked test, where stock's time goes on a MoE (op profile, fp32 vs
#    bf16 parameters), and one MoE all streamed at 64K tokens/step (Qwen3-30B-A3B width, 8 layers)
# I: Qwen3-30B-A3B width at the depth stock Trainer holds (11 layers): stock (fp32 parameters, bf16
#    autocast), stock with bf16 parameters (the speed anchor) and the default placement, 16K and 64K
# J: Gemma-2-9B shape, full depth, default placement, 16K tokens/step (MFU against the sustained peak);
#    the MoE profile again (by aten op); H's all-streamed MoE without clipping (AdamW during the backward)
# K: issue 20: the GPU tests, then the 3B shape all streamed at 64K tokens/step as 64x1, and as 16x4 with
#    the micro-batches through each layer together and one at a time
# L, M: issue 20 at scale: the 13B shape at 64K tokens/step asked as 16 x 4 and 64 x 1 beside 16K; Mixtral-8x7B
#    width (4 layers, all streamed) at 16K and 64K
# N: issue 20's closing check: the GPU tests, and the 3B shape at 16K tokens/step beside stock
# O, P, Q: issue 20's step-time model and host AdamW. Each call first runs `hf-megatrain probe` (its rates,
#    cached under $OUT/rates, are what every hf_megatrain row's prediction uses: "x model" in the tables).
#    O: the host AdamW's tile sizes (run 14 also timed a variant since removed), Mixtral-8x7B width
#    (4 layers, all streamed) at 16K and 64K. P: the 3B shape all streamed at 64K as 64x1 and 16x4 together,
#    and at 16K default placement beside stock. Q: the 7B shape at 16K beside stock, every gpu-marked test.
# S, T, U: issue 21's memory modes: S the GPU tests and the 13B shape with and without lean_streamed; T the
#    largest model with clipping (Qwen2.5-14B shape); U the largest without (dense-18b, 18.3 B); V the GPU
#    tests (gradients of streamed layers on the GPU among them) and the probe; W the 14.8 B shape with
#    clipping at 16K tokens/step (gradients of streamed layers on the GPU); X dense-18b with clipping through
#    transient_grads' norm pass.
# Y: issue 33's second check (needs the H200: the 13B shape does not fit an H100 box; Y_SHAPE=llama-3.1-8b there): the 13B shape at 64K
#    tokens/step asked as 16 x 4 (default placement, clipping 1.0), this code beside the code before the change
#    (.old, as in G), one checkpoint written once for both.
# Z: issue 34 (needs the H200: 139 GiB GPU, ~123 GiB host), the machine's rates first (the probe now times the
#    host sgd / adagrad / rmsprop / adafactor steps too). `Z a`: the largest dense model Adafactor trains at 16K
#    tokens/step with clipping 1.0: the Qwen2.5-32B shape (32.8 B) at the most layers the trainer's planner admits
#    on this machine and whose checkpoint the disk holds (largest.py --layers fit; the CPU estimate for 139 + 123
#    GiB: 56 of 64 layers, 28.9 B, host 116.7 GiB, GPU 130.3 GiB), host and GPU peaks against the estimate,
#    tokens/s against the step-time model. `Z b`: the 13B shape at 16K tokens/step, Adafactor beside AdamW, one
#    checkpoint for both. `Z` runs both (more than one call's 10 minutes: give each half its own call; a fresh
#    machine may spend most of `Z a` writing the ~54 GiB checkpoint: a second `Z a` on the warm machine reuses it).
# DPO: issue 36 (needs the H200, as Y): the 13B shape at 16K tokens/step, default placement, clipping 1.0, DPO (8
#    preference examples of 512 + 512 + 512 tokens: 16 rows of 1024) beside SFT at the same 16 x 1024 tokens, one
#    checkpoint for both (Y's, reused on a warm machine); the DPO record times the reference pass on its own
#    (benchmarks/dpo_bench.py).
# ZOO: issue 35 (needs the H200: stock holds these in fp32 only there): a DeepSeek-V3-width MoE (MLA; 32 routed
#    experts, shapes.py says why; 3 layers, the first dense) and the Qwen3.5 shape (gated delta-nets, 16 of 32
#    layers), each at 16K tokens/step with clipping 1.0: stock Trainer with fp32 parameters under bf16 autocast,
#    stock with bf16 parameters (the speed anchor) and the default placement, MFU on active parameters.
#    DSV3_LAYERS and QWEN35_LAYERS set the depths (an H100 box: 2 and 8, what stock holds there in fp32).
# (Run 7 in BENCHMARKS.md gives the commands of the earlier groups: 70B width, 7B, 7B at 256K.)
# Every call first writes $OUT/versions.json and prints one VERSIONS line (benchmarks/versions.py:
# Python, torch, CUDA, transformers, accelerate, peft, GPU and driver, hf_megatrain commit); each
# benchmark's own JSON states them too. The device gets the work tree without .git: name the commit
# in the command, `HF_MEGATRAIN_COMMIT=<short hash> bash benchmarks/suite.sh A`, or it is recorded
# as unknown.
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
timeout 120 python3 benchmarks/versions.py --json "$OUT/versions.json" || echo "VERSIONS not recorded (exit $?)"
export HF_MEGATRAIN_CACHE="$OUT/rates"  # the probe's cache: the rates this call's predictions ran on
names=()
part() {  # part SECONDS NAME command...: run, keep its log, never stop the suite
  local limit=$1 name=$2; shift 2
  names+=("$name")
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "   exit $?"
}
keep_only() {  # a warm machine keeps the checkpoints of earlier calls: free the disk of all but this one
  find /tmp/largest /tmp/ckpt -mindepth 1 -maxdepth 1 ! -name "$1" -exec rm -rf {} + 2>/dev/null; df -h /tmp | tail -1
}
case "${1:-A}" in
A)
  part 150 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py
  part 120 optimizer python3 benchmarks/optimizer_bench.py --shape llama-3.2-1b --layers 4 --threads 0 15 \
    --spans 19 21
  part 340 bench_3b python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 16384 65536 --clip 1.0 0.0 \
    --systems megatrain:0,stock --steps 5 --warmup 2 --out "$OUT" ;;
B)
  for n in 8 16 32; do
    part 70 depth_$n python3 benchmarks/bench.py --shape llama-3.2-1b --layers $n --tokens 16384 --clip 1.0 \
      --systems megatrain:0 --steps 4 --warmup 2 --skip_peak --out "$OUT/depth_$n"
  done
  part 360 bench_3b_64k python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 0.0 \
    --systems megatrain:auto,stock --steps 4 --warmup 2 --out "$OUT" ;;
C)
  part 315 offload_64k python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 \
    --systems megatrain:auto,deepspeed,fsdp2 --steps 2 --warmup 1 --skip_peak --out "$OUT" ;;
D)
  part 300 largest_13b python3 benchmarks/largest.py --shape llama-2-13b --steps 10 --warmup 2 --out "$OUT" ;;
E)
  part 580 long_3b python3 benchmarks/long_context.py --shape llama-3.2-3b --seq 524288 --out "$OUT" ;;
F)
  part 120 gpu_documents python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py -k by_document
  part 420 packed_3b python3 benchmarks/long_context.py --shape llama-3.2-3b --seq 524288 --doc_tokens 32768 \
    --out "$OUT" ;;
G)
  if [ "${2:-all}" != bench ]; then
    part 400 gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py \
      tests/integration/test_failures.py tests/integration/test_checkpoints.py tests/unit/test_contracts.py \
      tests/integration/test_model_state.py tests/integration/test_dpo.py tests/integration/test_kto.py \
      tests/integration/test_orpo.py \
      tests/integration/test_optimizers.py
  fi
  if [ "${2:-all}" != tests ]; then
    part 480 bench_3b_16k python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 16384 --clip ${CLIPS:-1.0} \
      --systems stock,megatrain:0,megatrain:0@.old,megatrain:auto,megatrain:auto@.old --steps 6 --warmup 2 \
      --out "$OUT"
  fi ;;
Y)
  export LARGEST_KEEP=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  shape=${Y_SHAPE:-llama-2-13b}  # Y_SHAPE=llama-3.1-8b: the same comparison on an H100 box
  for code in now old; do
    script=benchmarks/largest.py; [ "$code" = old ] && script=.old/benchmarks/largest.py  # imports .old's package
    part 290 64k_$code python3 $script --shape $shape --tokens 65536 --micro 16 --steps 5 --warmup 2 \
      --skip_all_host --tag "_$code" --out "$OUT/$code"
  done ;;
H)
  part 260 gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py \
    tests/integration/test_failures.py tests/integration/test_checkpoints.py tests/unit/test_contracts.py
  part 90 moe_profile python3 benchmarks/moe_profile.py --shape qwen3-30b-a3b --layers 2 --rows 4 --out "$OUT"
  part 230 moe_streamed python3 benchmarks/bench.py --shape qwen3-30b-a3b --layers 8 --tokens 65536 --clip 1.0 \
    --systems megatrain:0 --steps 4 --warmup 2 --from_disk /tmp/ckpt --out "$OUT" ;;
I)
  part 580 moe_vs_stock python3 benchmarks/bench.py --shape qwen3-30b-a3b --layers 11 --tokens 16384 65536 \
    --clip 1.0 --systems stock,stock_bf16,megatrain:auto --stock_micro 4 --steps 3 --warmup 1 --out "$OUT" ;;
J)
  part 330 gemma2_9b python3 benchmarks/bench.py --shape gemma-2-9b --tokens 16384 --clip 1.0 \
    --systems megatrain:auto --steps 6 --warmup 2 --from_disk /tmp/ckpt --out "$OUT/gemma"
  part 60 moe_profile python3 benchmarks/moe_profile.py --shape qwen3-30b-a3b --layers 4 --rows 4 --out "$OUT"
  part 170 moe_streamed_noclip python3 benchmarks/bench.py --shape qwen3-30b-a3b --layers 8 --tokens 65536 \
    --clip 0.0 --systems megatrain:0 --steps 4 --warmup 2 --skip_peak --from_disk /tmp/ckpt --out "$OUT/noclip" ;;
K)  # issue 20: a step's micro-batches through each layer together (layer_major_accumulation)
  part 200 gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py
  part 110 3b_64x1 python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 --systems megatrain:0 \
    --steps 5 --warmup 2 --out "$OUT/64x1"
  for lm in true false; do
    part 110 3b_16x4_$lm python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 \
      --systems megatrain:0 --mega_micro 16 --layer_major $lm --steps 5 --warmup 2 --skip_peak --out "$OUT/16x4_$lm"
  done ;;
L)  # issue 20: the 13B shape (full depth, default placement, clipping 1.0) at 64K tokens/step asked as 16 x 4
    # (the planner cuts it to fit) beside 16K tokens/step in one micro-batch; the checkpoint is kept for M
  export LARGEST_KEEP=1
  part 60 gpu_together python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py -k together
  part 330 13b_64k_16x4 python3 benchmarks/largest.py --shape llama-2-13b --tokens 65536 --micro 16 \
    --steps 6 --warmup 2 --skip_all_host --out "$OUT/64k_16x4"
  part 190 13b_16k python3 benchmarks/largest.py --shape llama-2-13b --tokens 16384 --steps 6 \
    --warmup 2 --skip_all_host --out "$OUT/16k" ;;
M)  # issue 20: L's 13B run at 64K asked as 16 x 4 with the allocator's expandable segments (L's ran out of
    # memory on fragmentation: 9 GiB reserved but unallocated); Mixtral-8x7B width, 4 layers, all streamed, 16K, 64K
  export LARGEST_KEEP=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  part 250 13b_64k_16x4 python3 benchmarks/largest.py --shape llama-2-13b --tokens 65536 --micro 16 \
    --steps 6 --warmup 2 --skip_all_host --out "$OUT/64k_16x4"
  part 300 mixtral_4l python3 benchmarks/bench.py --shape mixtral-8x7b --layers 4 --tokens 16384 65536 --clip 1.0 \
    --systems megatrain:0 --steps 4 --warmup 2 --skip_peak --from_disk /tmp/ckpt --out "$OUT/mixtral" ;;
N)  # issue 20, the closing check: every gpu-marked test on the final code, and no regression at 16K tokens/step
    # (3B shape, default placement, one micro-batch per step) beside stock
  part 200 gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py
  part 300 bench_3b_16k python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 16384 --clip 1.0 \
    --systems stock,megatrain:auto --steps 6 --warmup 2 --out "$OUT" ;;
O)
  part 60 probe python3 -m hf_megatrain.cli probe
  part 150 optimizer python3 benchmarks/optimizer_bench.py --shape llama-3.2-1b --layers 4 --threads 0 \
    --tiles 18 19 20 21 23
  part 320 mixtral_4l python3 benchmarks/bench.py --shape mixtral-8x7b --layers 4 --tokens 16384 65536 --clip 1.0 \
    --systems megatrain:0 --steps 4 --warmup 2 --from_disk /tmp/ckpt --out "$OUT/mixtral" ;;
O2)  # O again where it was noisy: the worker thread's host AdamW three times per row; Mixtral with 2^23 tiles
  part 60 probe python3 -m hf_megatrain.cli probe
  part 100 optimizer python3 benchmarks/optimizer_bench.py --shape llama-3.2-1b --layers 4 --threads 0 \
    --tiles 20 21 23 --where thread --repeat 3
  HF_MEGATRAIN_ADAMW_TILE=23 part 200 mixtral_4l_tile23 python3 benchmarks/bench.py --shape mixtral-8x7b --layers 4 \
    --tokens 16384 65536 --clip 1.0 --systems megatrain:0 --steps 4 --warmup 2 --skip_peak --from_disk /tmp/ckpt \
    --out "$OUT/mixtral23"
  part 110 3b_64x1 python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 --systems megatrain:0 \
    --steps 5 --warmup 2 --skip_peak --out "$OUT/64x1"
  part 110 3b_16x4 python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 --systems megatrain:0 \
    --mega_micro 16 --layer_major true --steps 5 --warmup 2 --skip_peak --out "$OUT/16x4" ;;
P)
  part 60 probe python3 -m hf_megatrain.cli probe
  part 110 3b_64x1 python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 --systems megatrain:0 \
    --steps 5 --warmup 2 --skip_peak --out "$OUT/64x1"
  part 110 3b_16x4 python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 --systems megatrain:0 \
    --mega_micro 16 --layer_major true --steps 5 --warmup 2 --skip_peak --out "$OUT/16x4"
  part 230 bench_3b_16k python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 16384 --clip 1.0 \
    --systems stock,megatrain:auto --steps 6 --warmup 2 --out "$OUT/16k" ;;
Q)
  part 60 probe python3 -m hf_megatrain.cli probe
  part 300 bench_7b_16k python3 benchmarks/bench.py --shape qwen2.5-7b --tokens 16384 --clip 1.0 \
    --systems megatrain:auto,stock --stock_micro 2 --steps 5 --warmup 2 --from_disk /tmp/ckpt --out "$OUT"
  part 210 gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py ;;
R)  # issue 20's closing measurements on the final code: O's Mixtral, P's 3B rows
  part 60 probe python3 -m hf_megatrain.cli probe
  part 200 mixtral_4l python3 benchmarks/bench.py --shape mixtral-8x7b --layers 4 --tokens 16384 65536 --clip 1.0 \
    --systems megatrain:0 --steps 4 --warmup 2 --skip_peak --from_disk /tmp/ckpt --out "$OUT/mixtral"
  part 100 3b_64x1 python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 --systems megatrain:0 \
    --steps 5 --warmup 2 --skip_peak --out "$OUT/64x1"
  part 100 3b_16x4 python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 65536 --clip 1.0 --systems megatrain:0 \
    --mega_micro 16 --layer_major true --steps 5 --warmup 2 --skip_peak --out "$OUT/16x4"
  part 150 bench_3b_16k python3 benchmarks/bench.py --shape llama-3.2-3b --tokens 16384 --clip 1.0 \
    --systems stock,megatrain:auto --steps 6 --warmup 2 --out "$OUT/16k" ;;
S)  # issue 21: every gpu-marked test (the host memory modes on the GPU), then the 13B shape at 16K tokens/step,
    # 21 layers resident, with the default host layout and with lean_streamed, one checkpoint for both
  export LARGEST_KEEP=1
  part 200 gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py \
    tests/integration/test_failures.py tests/integration/test_checkpoints.py tests/unit/test_contracts.py
  for lean in false true; do
    part 190 13b_16k_lean_$lean python3 benchmarks/largest.py --shape llama-2-13b --tokens 16384 --resident 21 \
      --lean_streamed $lean --transient_grads false --steps 7 --warmup 2 --skip_all_host --tag _lean_$lean --out "$OUT"
  done ;;
T)  # issue 21: the largest model with clipping at 1.0, Qwen2.5-14B shape (14.8 B), 8K tokens/step, the planner's
    # placement and memory modes, 12 optimizer steps on a learnable task
  keep_only qwen2.5-14b-full
  part 540 14b_clip python3 benchmarks/largest.py --shape qwen2.5-14b --tokens 8192 --clip 1.0 --lr 1e-4 --learnable \
    --steps 12 --warmup 2 --out "$OUT" ;;
U)  # issue 21: the largest model without clipping, dense-18b (18.3 B), 16K tokens/step (8K if the planner refuses
    # 16K on this host), the planner's placement and memory modes, 12 optimizer steps on a learnable task
  export LARGEST_KEEP=1
  keep_only dense-18b-full
  part 400 18b_noclip python3 benchmarks/largest.py --shape dense-18b --tokens 16384 --clip 0 --lr 1e-4 --learnable \
    --steps 12 --warmup 2 --skip_all_host --skip_disk_check --out "$OUT"
  if grep -q "does not fit" "$OUT/18b_noclip.log"; then
    part 300 18b_noclip_8k python3 benchmarks/largest.py --shape dense-18b --tokens 8192 --clip 0 --lr 1e-4 \
      --learnable --steps 12 --warmup 2 --skip_all_host --skip_disk_check --out "$OUT"
  fi ;;
V)  # issue 21, item 3: every gpu-marked test (gradients kept on the GPU among them), then the machine's rates
    # (the host AdamW of a lean unit among them)
  part 200 gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py \
    tests/integration/test_failures.py tests/integration/test_checkpoints.py tests/unit/test_contracts.py
  part 40 probe python3 -m hf_megatrain.cli probe --seconds 3 --no_save --json ;;
W)  # issue 21, item 3: the Qwen2.5-14B shape with clipping at 16K tokens/step, which fits with the last streamed
    # layers' gradients on the GPU (a call of its own: a fresh machine first writes the 30 GB checkpoint). The
    # plan fills 94% of the card: expandable segments, as the trainer's allocator advice says
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  keep_only qwen2.5-14b-full
  part 560 14b_clip_16k python3 benchmarks/largest.py --shape qwen2.5-14b --tokens 16384 --clip 1.0 --lr 1e-4 \
    --learnable --steps 12 --warmup 2 --skip_all_host --skip_disk_check --tag _16k --out "$OUT" ;;
X)  # transient_grads with exact clipping (a norm pass first): dense-18b (18.3 B) with clipping at 1.0, 16K
    # tokens/step, lean_streamed and transient_grads asked for, 12 steps on a learnable task (U ran it unclipped)
  export LARGEST_KEEP=1
  keep_only dense-18b-full
  part 560 18b_clip_norm_pass python3 benchmarks/largest.py --shape dense-18b --tokens 16384 --clip 1.0 --lr 1e-4 \
    --learnable --steps 12 --warmup 2 --lean_streamed true --transient_grads true --skip_all_host --skip_disk_check \
    --tag _norm_pass --out "$OUT" ;;
Z)  # issue 34: Adafactor on the host (see the header). The plans fill most of the card: expandable segments
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True LARGEST_KEEP=1
  part 60 probe python3 -m hf_megatrain.cli probe
  if [ "${2:-all}" != b ]; then
    keep_only "qwen2.5-32b-*"  # (a checkpoint of the depth --layers fit picks is reused, any other one written)
    part 530 32b_adafactor python3 benchmarks/largest.py --shape qwen2.5-32b --layers fit --optim adafactor \
      --tokens 16384 --clip 1.0 --lr 1e-4 --learnable --steps 6 --warmup 2 --skip_all_host --skip_disk_check \
      --tag _adafactor --out "$OUT"
  fi
  if [ "${2:-all}" != a ]; then
    keep_only llama-2-13b-full
    for optim in adafactor adamw_torch; do
      part 260 13b_16k_$optim python3 benchmarks/largest.py --shape llama-2-13b --tokens 16384 --clip 1.0 \
        --optim $optim --steps 7 --warmup 2 --skip_all_host --tag _$optim --out "$OUT"
    done
  fi ;;
DPO)
  export LARGEST_KEEP=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  shape=${DPO_SHAPE:-llama-2-13b}  # DPO_SHAPE=llama-3.1-8b: the same rows on an H100 box
  keep_only $shape-full
  part 280 16k_sft python3 benchmarks/largest.py --shape $shape --tokens 16384 --clip 1.0 --steps 6 \
    --warmup 2 --skip_all_host --tag _sft --out "$OUT"
  part 300 16k_dpo python3 benchmarks/dpo_bench.py --shape $shape --pairs 8 --prompt 512 --completion 512 \
    --steps 6 --warmup 2 --clip 1.0 --out "$OUT" ;;
ZOO)
  part 290 deepseek_v3_width python3 benchmarks/bench.py --shape deepseek-v3-width --layers ${DSV3_LAYERS:-3} --tokens 16384 \
    --clip 1.0 --systems stock,stock_bf16,megatrain:auto --stock_micro 4 --steps 3 --warmup 1 --out "$OUT/dsv3"
  part 290 qwen3_5 python3 benchmarks/bench.py --shape qwen3.5-9b --layers ${QWEN35_LAYERS:-16} --tokens 16384 --clip 1.0 \
    --systems stock,stock_bf16,megatrain:auto --stock_micro 4 --steps 3 --warmup 1 --out "$OUT/qwen3_5" ;;
*) echo "unknown group $1 (A to Z, DPO, ZOO)"; exit 2 ;;
esac
for f in "${names[@]}"; do echo "== $f"; tail -n 14 "$OUT/$f.log"; done
