#!/usr/bin/env bash
# Session 5 final one-GPU runs behind docs/benchmarks.md "Session 5" (H200, torch 2.11, torchao 0.17 wheel in .whl/). Usage: OUT=dir bash benchmarks/gpu_run_s5a.sh
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; fi
py=python3
export PYTHONPATH=.:/tmp/site
timeout 120 $py -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | grep -v DEBUG | tail -25 > "$out/gpu_tests.txt"
tail -1 $out/gpu_tests.txt
timeout 60 $py benchmarks/host_overhead.py --device cuda > "$out/host_overhead.txt" 2>&1
tail -8 $out/host_overhead.txt
timeout 250 $py benchmarks/e2e.py --size 2048 --variants bf16@fsdp,rowwise@fsdp,rowwise_gw_hp@fsdp,ao_tensorwise@fsdp,ao_rowwise@fsdp,bf16@plain,rowwise@plain,ao_tensorwise@plain,bf16@tp,rowwise@tp --json $out/e2e_2048.json > "$out/e2e_2048.txt" 2>&1
tail -13 $out/e2e_2048.txt
timeout 90 $py benchmarks/e2e.py --size 2048 --gc step --variants bf16@fsdp,rowwise@fsdp,ao_tensorwise@fsdp --json $out/e2e_2048_gcstep.json > "$out/e2e_2048_gcstep.txt" 2>&1
tail -5 $out/e2e_2048_gcstep.txt
