#!/usr/bin/env bash
# Session 8, part D (H200, torch 2.11, torchao 0.17 wheel in .whl/): dim 2048 with FSDP2, without FSDP2 and under
# a 1-rank TP mesh without FSDP2, default compile and CUDA graphs (+cg); the README model.
# Usage: OUT=dir bash benchmarks/gpu_run_s8d.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
show() { grep -E "^\|" "$1" | cut -c1-200; grep -E "FAILED" "$1" | cut -c1-200; }
timeout 400 python3 benchmarks/e2e.py --size 2048 --warmup 25 --variants bf16@fsdp,rowwise@fsdp+cg,rowwise@fsdp,rowwise_gw_hp@fsdp+cg,ao_tensorwise@fsdp,ao_rowwise@fsdp,bf16@plain+cg,rowwise@plain+cg,rowwise_gw_hp@plain+cg,ao_tensorwise@plain+cg,bf16@tp_plain+cg,rowwise@tp_plain+cg --json $out/s8_e2e_2048.json > "$out/s8_e2e_2048.txt" 2>&1
show $out/s8_e2e_2048.txt
grep -E "CUDA-graph trees in the timed" $out/s8_e2e_2048.txt | sed -E 's/.*# ([^:]*):.*(CUDA-graph trees in the timed steps: \{[^}]*\}).*/\1 \2/'
timeout 150 python3 benchmarks/e2e.py --size readme --warmup 25 --variants bf16@plain+cg,rowwise@plain+cg,rowwise_gw_hp@plain+cg,bf16@fsdp,rowwise@fsdp+cg --json $out/s8_e2e_readme.json > "$out/s8_e2e_readme.txt" 2>&1
show $out/s8_e2e_readme.txt
