#!/usr/bin/env bash
# Session 7, part A (H200, torch 2.11, torchao 0.17 wheel in .whl/): tests/gpu on the collectives change, host
# profiles (cProfile) of the dim-2048 FSDP2 step for bf16 and rowwise+cg, and rowwise_gw_hp with CUDA graphs on the
# README model and dim 2048 without FSDP2.
# Usage: OUT=dir bash benchmarks/gpu_run_s7a.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | grep -v DEBUG | tail -25 > "$out/gpu_tests.txt"
tail -1 $out/gpu_tests.txt
timeout 150 python3 benchmarks/e2e.py --size readme --warmup 25 --variants bf16@plain+cg,rowwise@plain+cg,rowwise_gw_hp@plain+cg,bf16@plain --json $out/s7_e2e_readme.json > "$out/s7_e2e_readme.txt" 2>&1
grep -E "^\|" $out/s7_e2e_readme.txt
timeout 200 python3 benchmarks/e2e.py --size 2048 --warmup 25 --cprofile 5 --variants bf16@fsdp,rowwise@fsdp+cg,rowwise_gw_hp@plain+cg --json $out/s7_e2e_2048_prof.json > "$out/s7_e2e_2048_prof.txt" 2>&1
grep -E "^\|" $out/s7_e2e_2048_prof.txt
