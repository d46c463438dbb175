#!/usr/bin/env bash
# Session 9's plan for the next device time (H200, torch 2.11, torchao 0.17 wheel in .whl/; ~9 minutes): tests/gpu,
# the eager-path and drop-in tests on CUDA (autocast: the fp8 GEMMs must stay fp8 there), host_overhead.py, and the
# decision on fp8tensor.quantize.INLINE_AFTER_OPS: dim 2048 under FSDP2 (default compile: host-bound, the inline
# weight ops remove one Python op per Linear backward) and dim 4096 (peak memory must not rise), each off / on in
# one process (6 files back: under the 8 a call returns). Usage: OUT=dir bash benchmarks/gpu_run_s9.sh   (then gpu_run_s8d.sh for the CUDA-graph rows)
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
show() { grep -E "^\||^# e2e" "$1" | cut -c1-200; grep -E "FAILED" "$1" | cut -c1-200; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_eager_parts.py tests/test_dropin.py 2>&1 \
  | grep -v DEBUG | tail -25 > "$out/gpu_tests.txt"
grep -E "FAILED|passed|failed" $out/gpu_tests.txt | tail -5
timeout 80 python3 benchmarks/host_overhead.py --device cuda > "$out/s9_host_overhead.txt" 2>&1
tail -4 $out/s9_host_overhead.txt
for inl in 0 1; do
  timeout 110 python3 benchmarks/e2e.py --size 2048 --inline-after-ops $inl --variants bf16@fsdp,rowwise@fsdp > "$out/s9_e2e_2048_inline$inl.txt" 2>&1
  show $out/s9_e2e_2048_inline$inl.txt
done
for inl in 0 1; do
  timeout 120 python3 benchmarks/e2e.py --size 4096 --inline-after-ops $inl --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp > "$out/s9_e2e_4096_inline$inl.txt" 2>&1
  show $out/s9_e2e_4096_inline$inl.txt
done
