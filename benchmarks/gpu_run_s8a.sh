#!/usr/bin/env bash
# Session 8, part A (H200, torch 2.11): where the host time of one fp8 Linear goes on the GPU machine —
# host_overhead.py with cProfile of the eager and compiled setups, fp8tensor and the bare reference.
# Usage: OUT=dir bash benchmarks/gpu_run_s8a.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 240 python3 benchmarks/host_overhead.py --device cuda --profile lib,bare,lib_compiled,bare_compiled > "$out/s8a_host_profile.txt" 2>&1
tail -8 $out/s8a_host_profile.txt
