"""The suite's own harness: a failing test's report names its seed, and a module that leaves a process group
initialized fails instead of making later modules' outcomes depend on the order they run in."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent

INNER = '''
import torch
import torch.distributed as dist

def test_fails():
    assert torch.rand(()).item() > 2.0

def test_leaks_a_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
'''

LATER = '''
import torch.distributed as dist

def test_no_group_here():
    assert not dist.is_initialized()
'''


def _run(tmp_path, env_seed=None):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "test_later.py").write_text(LATER)
    env = {k: v for k, v in os.environ.items() if k != "FP8TENSOR_TEST_SEED"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    if env_seed is not None:
        env["FP8TENSOR_TEST_SEED"] = str(env_seed)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--tb=line",
                           "test_inner.py", "test_later.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_failure_report_names_the_seed_and_leaked_group_fails_its_module(tmp_path):
    r = _run(tmp_path, env_seed=1234)
    out = r.stdout + r.stderr
    # -s (no capture) and --tb=line: the seed still appears in the failure's report section
    assert re.search(r"seed.*\n.*FP8TENSOR_TEST_SEED=1234 +\(replay: FP8TENSOR_TEST_SEED=1234 python -m pytest "
                     r"'test_inner.py::test_fails'\)", out), out[-3000:]
    assert "test_inner.py left a process group initialized" in out, out[-3000:]
    assert "1 failed, 2 passed, 1 error" in out, out[-3000:]
    assert "test_later.py::test_no_group_here" not in out.split("short test summary")[-1]  # the later module passed
