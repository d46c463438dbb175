#!/usr/bin/env bash
# MoE on one H200 (torch >= 2.11): the CUDA tests of the fp8 grouped GEMMs, then benchmarks/moe.py (DeepSeek-V3-like
# and Qwen3-30B-A3B-like local shapes, with torchao's prototype when installed). Usage: OUT=dir bash benchmarks/gpu_run_moe.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi  # torchao
export PYTHONPATH=.:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_moe.py tests/test_moe.py 2>&1 | tail -30 > "$out/moe_gpu_tests.txt"
grep -E "FAILED|passed|failed" "$out/moe_gpu_tests.txt" | tail -8
timeout 400 python3 benchmarks/moe.py --out "$out/moe.json" --profile > "$out/moe_bench.txt" 2>&1
grep -E "^\||^# moe|Error" "$out/moe_bench.txt"
