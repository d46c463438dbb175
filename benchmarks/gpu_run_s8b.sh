#!/usr/bin/env bash
# Session 8, part B (H200, torch 2.11, torchao 0.17 wheel in .whl/): tests/gpu and the eager-path bit-identity test
# on CUDA, host_overhead.py before/after the eager plain-tensor path (same process kind, same machine), and dim 2048
# with FSDP2 and without. Usage: OUT=dir bash benchmarks/gpu_run_s8b.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_eager_parts.py 2>&1 | grep -v DEBUG | tail -25 > "$out/gpu_tests.txt"
tail -1 $out/gpu_tests.txt
for i in 1 2; do
timeout 60 python3 benchmarks/host_overhead.py --device cuda --no-eager-parts --only eager,dtensor > "$out/s8_host_overhead_before_$i.txt" 2>&1
tail -3 $out/s8_host_overhead_before_$i.txt
timeout 60 python3 benchmarks/host_overhead.py --device cuda > "$out/s8_host_overhead_$i.txt" 2>&1
tail -4 $out/s8_host_overhead_$i.txt
done
timeout 330 python3 benchmarks/e2e.py --size 2048 --warmup 25 --variants bf16@fsdp,rowwise@fsdp+cg,rowwise@fsdp,ao_tensorwise@fsdp,bf16@plain+cg,rowwise@plain+cg,ao_tensorwise@plain+cg --json $out/s8_e2e_2048.json > "$out/s8_e2e_2048.txt" 2>&1
grep -E "^\||^# .*failures" $out/s8_e2e_2048.txt | cut -c1-200
grep -E "CUDA-graph trees in the timed" $out/s8_e2e_2048.txt | sed -E 's/.*# ([^:]*):.*(CUDA-graph trees in the timed steps: \{[^}]*\}).*/\1 \2/'
