#!/usr/bin/env bash
# Session 5: profiled dim-2048 FSDP2 steps and the GPU idle time attributed to host ranges (docs/benchmarks.md "Session 5"). Usage: OUT=dir bash benchmarks/gpu_run_s5_trace.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
mkdir -p /tmp/tr
timeout 150 python3 benchmarks/e2e.py --size 2048 --variants bf16@fsdp,rowwise@fsdp --profile --gc step --steps 8 --warmup 4 --trace-dir /tmp/tr > $OUT/e2e_prof.txt 2>&1
tail -4 $OUT/e2e_prof.txt
ls -la /tmp/tr
for f in /tmp/tr/*.json; do echo "== $f"; timeout 60 python3 benchmarks/trace_gaps.py $f 2>&1 | head -40; done > $OUT/gaps.txt
cat $OUT/gaps.txt | head -60
