#!/usr/bin/env bash
# Session 7 final one-GPU runs, part D (H200, torch 2.11, torchao 0.17 wheel in .whl/): the DTensor row without
# FSDP2 (1-rank TP mesh, tp_plain) next to the plain row, with CUDA graphs; dims 4096 / 8192 under FSDP2; the README
# model. Usage: OUT=dir bash benchmarks/gpu_run_s7d.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
show() { grep -E "^\|" "$1" | cut -c1-200; grep -E "FAILED" "$1" | cut -c1-200; }
timeout 170 python3 benchmarks/e2e.py --size 2048 --warmup 25 --variants bf16@tp_plain+cg,rowwise@tp_plain+cg,rowwise@tp_plain,bf16@plain+cg,rowwise@plain+cg --json $out/s7_e2e_2048_tp.json > "$out/s7_e2e_2048_tp.txt" 2>&1
show $out/s7_e2e_2048_tp.txt
grep -E "CUDA-graph trees in the timed" $out/s7_e2e_2048_tp.txt | sed -E 's/.*# ([^:]*):.*(CUDA-graph trees in the timed steps: \{[^}]*\}).*/\1 \2/'
timeout 130 python3 benchmarks/e2e.py --size 4096 --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp --json $out/s7_e2e_4096.json > "$out/s7_e2e_4096.txt" 2>&1
show $out/s7_e2e_4096.txt
timeout 130 python3 benchmarks/e2e.py --size 8192 --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp --json $out/s7_e2e_8192.json > "$out/s7_e2e_8192.txt" 2>&1
show $out/s7_e2e_8192.txt
timeout 110 python3 benchmarks/e2e.py --size readme --warmup 25 --variants bf16@plain+cg,rowwise@plain+cg,rowwise_gw_hp@plain+cg,bf16@fsdp,rowwise@fsdp+cg --json $out/s7_e2e_readme.json > "$out/s7_e2e_readme.txt" 2>&1
show $out/s7_e2e_readme.txt
