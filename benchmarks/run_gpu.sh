#!/usr/bin/env bash
# The one GPU runner behind docs/benchmarks.md: each STAGE writes its output under OUTDIR (default: $OUT, else out/).
# torchao, when its wheel lies in .whl/ (see docs/benchmarks.md), is installed into /tmp/site for the peer rows.
#
# Usage: bash benchmarks/run_gpu.sh STAGE [STAGE ...]
#   tests        the GPU tests (tests/gpu)
#   graph        the whole-step CUDA-graph tests (tests/gpu/test_gpu_graph_step.py)
#   e2e-SIZE     benchmarks/e2e.py at SIZE (2048, 4096, 8192, readme, moe, moe-fine; E2E_ARGS: more flags, e.g. --profile): default compile and whole-step graph rows,
#                bf16 / fp8tensor rowwise, rowwise_gw_hp / torchao tensorwise, rowwise; plain FSDP2 and DTensor (tp)
#   linear       benchmarks/linear.py (per-layer forward + backward, M = 16384)
#   memory-4096  benchmarks/memory.py at dim 4096 (FSDP2, compiled blocks, one AdamW over all parameters)
#   moe          benchmarks/moe.py (MoE experts forward + backward, DeepSeek-V3-like and Qwen3-30B-A3B-like shapes),
#                then benchmarks/moe.py --raw-gemms (torch._scaled_grouped_mm alone, fast / slow accumulation, vs bf16)
#                and benchmarks/moe.py --quant (the backward operands' quantizations alone: tokens per group column, weights)
#   serve        tests/gpu/test_gpu_export.py (torch.export + AOTInductor) and benchmarks/serve.py (decode / prefill,
#                eager / compile, bf16 / fp8tensor / torchao) at Llama3-8B shapes (SERVE_ARGS="--model readme": the
#                README model); compiled rows with --parallel
#   quant        benchmarks/linear.py --quant (the quantization kernels' µs and GB/s against a copy, 8192 tokens)
#   host         benchmarks/linear.py --host (host time of one eager Linear forward: nn.Linear vs fp8)
#   serve-host   benchmarks/serve.py --host (host time per eager call: F.linear, nn.Linear, a quantize_weights Linear)
#   size-rule    benchmarks/linear.py --size-rule --quick (fp8 vs bf16 per Linear shape at small sizes)
#   train        examples/train.py --cuda-graph on the README model (1200 steps, bf16 / rowwise / rowwise --size-rule)
#   train-seeds  bf16 alone over seeds 0 1 2 with the same flags (examples/seed_spread.py): bf16's seed-to-seed spread,
#                printed beside the fp8 gap of the `train` stage (run `train` first, in the same OUTDIR)
# JSON: e2e-*, linear and size-rule write docs/results records (command, date, GPU, torch version, commit,
# rows) into OUTDIR/record/; copy them into docs/results/ and render the tables with `python benchmarks/render.py`.
# moe, train and train-seeds write their own JSON (moe.json, moe_raw.json, moe_quant.json, train/losses.json, seeds/spread.json) in OUTDIR.
set -uo pipefail
out=${OUTDIR:-${OUT:-out}}; mkdir -p "$out/record"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
py=python3
table() { grep -E "^\||^# e2e|FAILED|Error" "$1" | cut -c1-220; }
# The README's GPU command (examples/train.py on the README model, whole-step CUDA graph); `train` and `train-seeds`
TRAIN_ARGS="--tp 1 --device cuda --compile --cuda-graph --steps 1200 --dim 1024 --layers 4 --heads 16 --kv-heads 4
            --seq-len 1024 --batch-size 16 --lr 1e-3 --max-bytes 60000000 --val-batches 16"
e2e_variants() {  # $1: size. Default compile and whole-step graph rows, bf16 / fp8tensor / torchao
  local g="bf16@fsdp+graph,rowwise@fsdp+graph,ao_tensorwise@fsdp+graph"
  case "$1" in
    2048) echo "bf16@fsdp,rowwise@fsdp,rowwise.fp8ag@fsdp,ao_tensorwise@fsdp,ao_rowwise@fsdp,bf16@tp,rowwise@tp,$g,rowwise.fp8ag@fsdp+graph,bf16@tp+graph,rowwise@tp+graph" ;;
    moe|moe-fine) echo "bf16@fsdp,rowwise@fsdp,rowwise.fp8ag@fsdp,rowwise_gw_hp@fsdp,bf16@fsdp+graph,rowwise@fsdp+graph,rowwise.fp8ag@fsdp+graph" ;;
    readme) echo "bf16@fsdp,rowwise.sized@fsdp,rowwise.sized.fp8ag@fsdp,ao_tensorwise@fsdp,$g,rowwise.sized@fsdp+graph" ;;
    *) echo "bf16@fsdp,rowwise@fsdp,rowwise.fp8ag@fsdp,ao_tensorwise@fsdp,$g" ;;
  esac
}
for stage in "$@"; do
  case "$stage" in
    tests) # five pytest processes side by side on the one GPU (the suite is bound by compiling on the host)
           groups=("tests/gpu/test_gpu_graph_step.py" "tests/gpu/test_gpu_w8_mm.py"
                   "tests/gpu/test_gpu_host.py tests/gpu/test_gpu_cudagraphs.py"
                   "tests/gpu/test_gpu_numerics.py tests/gpu/test_gpu_export.py tests/gpu/test_tp_2gpu.py tests/gpu/test_gpu_inference.py"
                   "tests/gpu/test_gpu_compile_path.py tests/gpu/test_gpu_moe.py")
           listed=$(echo "${groups[*]}" | tr ' ' '\n' | sort); present=$(ls tests/gpu/test_*.py | sort)
           [ "$listed" = "$present" ] || { echo "run_gpu.sh: tests/gpu files not in a group: $(comm -13 <(echo "$listed") <(echo "$present"))"; exit 2; }
           for i in "${!groups[@]}"; do
             timeout ${TESTS_TIMEOUT:-480} $py -m pytest -q -p no:cacheprovider -p no:logging --tb=short -W ignore \
               ${groups[$i]} > "$out/gpu_tests_$i.txt" 2>&1 &
           done
           wait
           cat "$out"/gpu_tests_[0-9].txt > "$out/gpu_tests.txt"; rm -f "$out"/gpu_tests_[0-9].txt
           grep -E "^E |FAILED|ERROR|passed|failed|error" "$out/gpu_tests.txt" | cut -c1-300 | tail -30 ;;
    graph) timeout 400 $py -m pytest -q -s -p no:cacheprovider -p no:logging --tb=short -W ignore \
             tests/gpu/test_gpu_graph_step.py > "$out/graph_tests.txt" 2>&1
           grep -E "bit-identical|Error|assert|^E |passed|failed" "$out/graph_tests.txt" | cut -c1-300 | tail -40 ;;
    e2e-*) size=${stage#e2e-}
           timeout ${E2E_TIMEOUT:-420} $py benchmarks/e2e.py --size "$size" --variants "${E2E_VARIANTS:-$(e2e_variants "$size")}" \
             --json "$out/e2e_$size.json" --record "$out/record/e2e_$size.json" ${E2E_ARGS:-} > "$out/e2e_$size.txt" 2>&1
           table "$out/e2e_$size.txt" ;;
    linear) timeout 300 $py benchmarks/linear.py --json "$out/record/linear.json" > "$out/linear.txt" 2>&1; table "$out/linear.txt" ;;
    memory-4096) timeout 300 $py benchmarks/memory.py --fsdp --dim 4096 --ffn 14336 --heads 32 --kv-heads 8 \
             --layers 4 --seq 8192 --warmup 1 --variants bf16@compile,rowwise@compile,rowwise_gw_hp@compile \
             > "$out/memory_4096.txt" 2>&1; tail -30 "$out/memory_4096.txt" ;;
    moe) timeout 300 $py benchmarks/moe.py --out "$out/moe.json" --profile > "$out/moe.txt" 2>&1; table "$out/moe.txt"
         timeout 150 $py benchmarks/moe.py --raw-gemms --out "$out/moe_raw.json" > "$out/moe_raw.txt" 2>&1; table "$out/moe_raw.txt"
         timeout 150 $py benchmarks/moe.py --quant --out "$out/moe_quant.json" > "$out/moe_quant.txt" 2>&1; table "$out/moe_quant.txt" ;;
    quant) timeout 200 $py benchmarks/linear.py --quant --json "$out/record/quant_kernels.json" > "$out/quant.txt" 2>&1; table "$out/quant.txt" ;;
    host) timeout 200 $py benchmarks/linear.py --host --json "$out/record/host_linear.json" > "$out/host.txt" 2>&1; table "$out/host.txt" ;;
    serve-host) timeout 120 $py benchmarks/serve.py --host > "$out/serve_host.txt" 2>&1; table "$out/serve_host.txt" ;;
    serve) { timeout 300 $py -m pytest -q -p no:cacheprovider -p no:logging --tb=short -W ignore tests/gpu/test_gpu_export.py
             timeout 200 $py benchmarks/serve.py --modes eager ${SERVE_ARGS:-}
             timeout $((${SERVE_TIMEOUT:-400} + 30)) $py benchmarks/serve.py --modes compile --parallel \
               --time-limit ${SERVE_TIMEOUT:-400} ${SERVE_ARGS:-}
           } > "$out/serve.txt" 2>&1
           grep -E "^\||^# serve|passed|failed|FAILED|Error" "$out/serve.txt" | cut -c1-220 ;;
    size-rule) timeout 300 $py benchmarks/linear.py --size-rule --quick --json "$out/record/size_rule.json" > "$out/size_rule.txt" 2>&1
           table "$out/size_rule.txt" ;;
    train) # the main job on one GPU: the README model, 1200 steps, whole-step CUDA graph; bf16 and fp8 rowwise, then
           # fp8 with the size-aware choice (TRAIN_SIZED=0 skips it)
           args=$TRAIN_ARGS
           timeout ${TRAIN_TIMEOUT:-300} $py examples/train.py $args --out "$out/train" > "$out/train.txt" 2>&1
           touch "$out/train_sized.txt"
           [ "${TRAIN_SIZED:-1}" = 1 ] && timeout 200 $py examples/train.py $args --mode fp8 --size-rule \
             --out "$out/train_sized" > "$out/train_sized.txt" 2>&1
           grep -hE "tok/s|final val|Error" "$out/train.txt" "$out/train_sized.txt" | cut -c1-220 ;;
    train-seeds) # bf16's own seed-to-seed spread at the `train` stage's flags (one bf16 run per seed), printed
           # beside the fp8 gap of that stage's run ($out/train/losses.json)
           timeout ${SEEDS_TIMEOUT:-400} $py examples/seed_spread.py --seeds 0 1 2 --nproc 1 --mode bf16 \
             --gap-from "$out/train/losses.json" --out "$out/seeds" -- $TRAIN_ARGS > "$out/train_seeds.txt" 2>&1
           tail -12 "$out/train_seeds.txt" ;;
    *) echo "run_gpu.sh: unknown stage $stage" >&2; exit 2 ;;
  esac
done
