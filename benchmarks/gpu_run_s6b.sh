#!/usr/bin/env bash
# Session 6 final one-GPU runs, part B: dim 2048 under a 1-rank TP mesh and torchao with CUDA graphs; dims 4096 and
# 8192 and the README model, default compile and CUDA graphs (+cg). Usage: OUT=dir bash benchmarks/gpu_run_s6b.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
export PYTHONPATH=.:/tmp/site
run() { name=$1; shift; timeout 200 python3 benchmarks/e2e.py --warmup 25 "$@" --json $out/s6_e2e_$name.json > "$out/s6_e2e_$name.txt" 2>&1; grep -E "^\|" $out/s6_e2e_$name.txt; }
run 2048b --size 2048 --variants bf16@tp,rowwise@tp,ao_tensorwise@plain+cg
run 4096 --size 4096 --variants bf16@fsdp,rowwise@fsdp,rowwise@fsdp+cg,ao_tensorwise@fsdp
run 8192 --size 8192 --variants bf16@fsdp,rowwise@fsdp,rowwise@fsdp+cg,ao_tensorwise@fsdp
run readme --size readme --variants bf16@fsdp,rowwise@fsdp,rowwise@fsdp+cg,bf16@plain+cg,rowwise@plain+cg
