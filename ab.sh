#!/usr/bin/env bash
# temporary A/B driver (not committed)
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
V=bf16@fsdp,rowwise@fsdp,rowwise@fsdp+graph
for r in 1 2; do
  for side in new old; do
    if [ $side = new ]; then pp=.; else pp=ab_old; fi
    PYTHONPATH=$pp:.:/tmp/site timeout 200 python3 benchmarks/e2e.py --size 2048 --variants $V --kernels --json $OUT/ab_${side}_$r.json > $OUT/ab_${side}_$r.txt 2>&1
    echo "== $side $r"; grep -E "^\|" $OUT/ab_${side}_$r.txt | cut -c1-200 | head -12
  done
done
TORCH_LOGS=output_code PYTHONPATH=. timeout 150 python3 benchmarks/e2e.py --size 2048 --layers 1 --variants rowwise@fsdp > $OUT/code_new.txt 2>&1
