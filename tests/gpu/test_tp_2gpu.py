"""TP=2 Llama block on 2 GPUs (NCCL, torchrun): fp8 with tensor + sequence parallelism equals the single-device fp8
block within rounding and the float64 reference within fp8 bounds. Skipped without 2 GPUs."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def test_tp_block_two_gpus():
    worker = os.path.join(os.path.dirname(__file__), "_tp_worker.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", worker],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][0]
    res = json.loads(line[len("RESULT "):])
    print(json.dumps(res, indent=1))
    for key, m in res.items():
        assert m["w_same"], key
        # TP fp8 is as accurate as single-device fp8 (sub-row-wise scales are finer) ...
        assert m["y_tp"] <= 1.5 * m["y_single"] + 1e-3, (key, m)
        assert m["gx_tp"] <= 1.5 * m["gx_single"] + 1e-3, (key, m)
        assert m["gw2_tp"] <= 1.5 * m["gw2_single"] + 1e-3, (key, m)
        # ... and both are within fp8 bounds of float64.
        assert m["y_tp"] < 6e-2 and m["gx_tp"] < 8e-2 and m["gw2_tp"] < 8e-2, (key, m)
