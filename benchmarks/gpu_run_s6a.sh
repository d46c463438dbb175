#!/usr/bin/env bash
# Session 6 final one-GPU runs, part A (docs/benchmarks.md "Session 6"; H200, torch 2.11, torchao 0.17 wheel in .whl/):
# tests/gpu, host_overhead, dim 2048 with and without FSDP2, default compile and CUDA graphs (+cg).
# Usage: OUT=dir bash benchmarks/gpu_run_s6a.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | grep -v DEBUG | tail -25 > "$out/gpu_tests.txt"
tail -1 $out/gpu_tests.txt
timeout 60 python3 benchmarks/host_overhead.py --device cuda > "$out/host_overhead.txt" 2>&1
tail -6 $out/host_overhead.txt
timeout 330 python3 benchmarks/e2e.py --size 2048 --warmup 25 --variants bf16@fsdp,rowwise@fsdp,rowwise@fsdp+cg,rowwise_gw_hp@fsdp+cg,ao_tensorwise@fsdp,ao_rowwise@fsdp,bf16@plain,bf16@plain+cg,rowwise@plain,rowwise@plain+cg,ao_tensorwise@plain --json $out/s6_e2e_2048.json > "$out/s6_e2e_2048.txt" 2>&1
grep -E "^\|" $out/s6_e2e_2048.txt
