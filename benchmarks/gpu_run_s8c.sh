#!/usr/bin/env bash
# Session 8, part C (H200, torch 2.11, torchao 0.17 wheel in .whl/): tests/gpu (with the inline backward weight
# ops) and the eager-path bit-identity test on CUDA, host_overhead.py twice, dims 4096 and 8192 under FSDP2 (speed
# and peak memory: the inline weight ops must not raise it). Usage: OUT=dir bash benchmarks/gpu_run_s8c.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
show() { grep -E "^\|" "$1" | cut -c1-200; grep -E "FAILED" "$1" | cut -c1-200; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_eager_parts.py 2>&1 | grep -v DEBUG | tail -25 > "$out/gpu_tests.txt"
grep -E "FAILED|passed|failed" $out/gpu_tests.txt | tail -5
for i in 1 2; do
timeout 80 python3 benchmarks/host_overhead.py --device cuda > "$out/s8_host_overhead_$i.txt" 2>&1
tail -4 $out/s8_host_overhead_$i.txt
done
timeout 130 python3 benchmarks/e2e.py --size 4096 --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp --json $out/s8_e2e_4096.json > "$out/s8_e2e_4096.txt" 2>&1
show $out/s8_e2e_4096.txt
timeout 130 python3 benchmarks/e2e.py --size 8192 --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp --json $out/s8_e2e_8192.json > "$out/s8_e2e_8192.txt" 2>&1
show $out/s8_e2e_8192.txt
