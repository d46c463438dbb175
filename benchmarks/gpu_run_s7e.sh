#!/usr/bin/env bash
# Session 7, part E (H200, torch 2.11): tests/gpu and the dim-2048 FSDP2 rows after the FSDP2 pre-all-gather's kept
# results are looked up per weight (no group lookup for the later weights of a group).
# Usage: OUT=dir bash benchmarks/gpu_run_s7e.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | grep -v DEBUG | tail -25 > "$out/gpu_tests_e.txt"
tail -1 $out/gpu_tests_e.txt
timeout 250 python3 benchmarks/e2e.py --size 2048 --warmup 25 --variants bf16@fsdp,rowwise@fsdp+cg,rowwise_gw_hp@fsdp+cg --json $out/s7e_e2e_2048_fsdp.json > "$out/s7e_e2e_2048_fsdp.txt" 2>&1
grep -E "^\|" $out/s7e_e2e_2048_fsdp.txt
grep -E "CUDA-graph trees in the timed" $out/s7e_e2e_2048_fsdp.txt | sed -E 's/.*# ([^:]*):.*(CUDA-graph trees in the timed steps: \{[^}]*\}).*/\1 \2/'
