#!/usr/bin/env bash
# The one-read quantization and the size rule on one GPU (H200; ~8 minutes): CUDA tests of the fused kernels and the
# eager path, the grad_out quantization costs and tile sweep (quant_cost.py), per-layer times (linear.py), the
# dim-2048 training step with the compiled backward's fused op off / on (FP8TENSOR_FUSED_GRAD_OUT_TRACED), and the
# size rule's calibration + fp8 vs bf16 GEMM kernels at small shapes (size_rule.py --quick).
# Usage: OUT=dir bash benchmarks/gpu_run_quant.sh [1|2]   (1: tests, quant_cost.py, linear.py, ~6 min;
# 2: the e2e step off / on and size_rule.py, ~7 min; both without an argument)
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
show() { grep -E "^\||^# |SIZE_RULE|Error" "$1" | cut -c1-220; }
part=${1:-all}
if [ "$part" != 2 ]; then
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_grad_out_fused.py tests/gpu/test_gpu_numerics.py \
  tests/test_eager_parts.py tests/test_grad_out_fused.py 2>&1 | tail -25 > "$out/quant_tests.txt"
grep -E "FAILED|passed|failed" "$out/quant_tests.txt" | tail -8
timeout 200 python3 benchmarks/quant_cost.py > "$out/quant_cost.txt" 2>&1; show "$out/quant_cost.txt"
timeout 150 python3 benchmarks/linear.py > "$out/quant_linear.txt" 2>&1; show "$out/quant_linear.txt"
fi
[ "$part" = 1 ] && exit 0
for t in 0 1; do
  FP8TENSOR_FUSED_GRAD_OUT_TRACED=$t timeout 150 python3 benchmarks/e2e.py --size 2048 --kernels \
    --variants bf16@fsdp,rowwise@fsdp > "$out/quant_e2e_2048_traced$t.txt" 2>&1
  show "$out/quant_e2e_2048_traced$t.txt"
done
timeout 200 python3 benchmarks/size_rule.py --quick > "$out/quant_size_rule.txt" 2>&1; show "$out/quant_size_rule.txt"
