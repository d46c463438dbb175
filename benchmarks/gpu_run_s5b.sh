#!/usr/bin/env bash
# Session 5 final one-GPU runs behind docs/benchmarks.md "Session 5" (H200, torch 2.11, torchao 0.17 wheel in .whl/). Usage: OUT=dir bash benchmarks/gpu_run_s5a.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
py=python3
export PYTHONPATH=.:/tmp/site
timeout 200 $py benchmarks/e2e.py --size 4096 --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp,ao_rowwise@fsdp --json $out/e2e_4096.json > "$out/e2e_4096.txt" 2>&1
tail -6 $out/e2e_4096.txt
timeout 190 $py benchmarks/e2e.py --size 8192 --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp --json $out/e2e_8192.json > "$out/e2e_8192.txt" 2>&1
tail -5 $out/e2e_8192.txt
timeout 100 $py benchmarks/e2e.py --size readme --variants bf16@fsdp,rowwise@fsdp --json $out/e2e_readme.json > "$out/e2e_readme.txt" 2>&1
tail -4 $out/e2e_readme.txt
