#!/usr/bin/env bash
# The one-GPU runs behind docs/benchmarks.md's 2026-12-01 tables (stage a: GPU tests, host overhead, dim 2048
# with all setups, memory; stage b: dims 4096/8192 and the README model) (H200, torch 2.11, torchao 0.17 from its wheel).
# Usage: bash benchmarks/gpu_run.sh STAGE OUTDIR     STAGE: a (GPU tests, host overhead, dim 2048, memory) | b (dims 4096/8192, README model)
set -uo pipefail
stage=$1; out=${2:-out}; mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
py=python3
if [ "$stage" = a ]; then
  timeout 150 $py -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -15 | tee "$out/gpu_tests.txt"
  timeout 60 $py benchmarks/host_overhead.py --device cuda 2>&1 | tee "$out/host_overhead.txt"
  timeout 240 $py benchmarks/e2e.py --size 2048 --json "$out/e2e_2048.json" 2>&1 | tee "$out/e2e_2048.txt"
  timeout 100 $py benchmarks/memory.py --fsdp --dim 4096 --ffn 14336 --heads 32 --kv-heads 8 --layers 4 --seq 8192 \
    --warmup 1 --variants bf16@compile,rowwise@compile,rowwise_gw_hp@compile 2>&1 | tail -40 | tee "$out/memory_4096.txt"
else
  # the final e2e rows of docs/benchmarks.md ("Session 4"); torchao rows where they fit
  timeout 190 $py benchmarks/e2e.py --size 4096 --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp,ao_rowwise@fsdp \
    --json "$out/e2e_4096.json" 2>&1 | tee "$out/e2e_4096.txt"
  timeout 190 $py benchmarks/e2e.py --size 8192 --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp,ao_rowwise@fsdp \
    --json "$out/e2e_8192.json" 2>&1 | tee "$out/e2e_8192.txt"
  timeout 110 $py benchmarks/e2e.py --size readme --variants bf16@fsdp,rowwise@fsdp \
    --json "$out/e2e_readme.json" 2>&1 | tee "$out/e2e_readme.txt"
fi
