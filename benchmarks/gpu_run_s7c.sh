#!/usr/bin/env bash
# Session 7 final one-GPU runs, part C (H200, torch 2.11, torchao 0.17 wheel in .whl/): tests/gpu, host_overhead,
# dim 2048 with FSDP2, without FSDP2 and under a 1-rank TP mesh without FSDP2 (tp_plain), default compile and CUDA
# graphs (+cg). Usage: OUT=dir bash benchmarks/gpu_run_s7c.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | grep -v DEBUG | tail -25 > "$out/gpu_tests.txt"
tail -1 $out/gpu_tests.txt
timeout 60 python3 benchmarks/host_overhead.py --device cuda > "$out/s7_host_overhead.txt" 2>&1
tail -6 $out/s7_host_overhead.txt
timeout 330 python3 benchmarks/e2e.py --size 2048 --warmup 25 --variants bf16@fsdp,rowwise@fsdp+cg,rowwise_gw_hp@fsdp+cg,ao_tensorwise@fsdp,ao_rowwise@fsdp,bf16@plain,bf16@plain+cg,rowwise@plain+cg,rowwise_gw_hp@plain+cg,ao_tensorwise@plain+cg,bf16@tp_plain+cg,rowwise@tp_plain+cg --json $out/s7_e2e_2048.json > "$out/s7_e2e_2048.txt" 2>&1
grep -E "^\||^# .*failures" $out/s7_e2e_2048.txt | cut -c1-200
grep -E "CUDA-graph trees in the timed" $out/s7_e2e_2048.txt | sed -E 's/.*# ([^:]*):.*(CUDA-graph trees in the timed steps: \{[^}]*\}).*/\1 \2/'
