#!/usr/bin/env bash
# Session 7, part B (H200, torch 2.11): tile sweep of the dim-0 quantization kernels on the e2e models' shapes.
# Usage: OUT=dir bash benchmarks/gpu_run_s7b.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
for m in 2048 4096 readme; do
  timeout 250 python3 benchmarks/dim0_sweep.py --model $m --top 6 > "$out/s7_dim0_sweep_$m.txt" 2>&1
  cat "$out/s7_dim0_sweep_$m.txt" | grep -v "^#" | cut -c1-220
done
