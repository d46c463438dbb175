"""Loss parity: a small Llama-style transformer trained on real text in bf16 and with fp8 ("rowwise") Linears.

Model: ``examples/llama.py`` (RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP), data:
``examples/data.py`` (bytes of the Python standard library sources, no download). Both runs start from the same
initial weights and see the same batches; the transformer blocks' Linears are converted with
``fp8_module_filter`` (embedding and output head stay bf16), as in ``examples/train.py``.

Pass criteria, over three seeds (the test's seed and the next two; each seed gives both runs the same initial
weights and batches): the mean over seeds of the relative gap between the fp8 run's final held-out loss and the bf16
run's is within 1 %, the same for the mean training loss of the last 20 steps, and no training loss is ever NaN/inf.
One run's gap is not a verdict: measured on this configuration, the gap is within 0.21 % for 14 of 15 seeds and
1.59 % for one (seed 1484962972, where the two runs drift apart from about step 120), so a single-run bound either
fails now and then or is too loose to catch a systematic shift.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp8tensor
from fp8tensor import Fp8MasterWeight, convert_to_fp8

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import data  # noqa: E402  (examples/data.py)
import llama  # noqa: E402  (examples/llama.py)

STEPS = 200
BATCH, SEQ = 8, 64
LR = 3e-3


def _train(fp8: bool, train_bytes, val_batches, seed: int):
    torch.manual_seed(seed)  # same init for both runs
    args = llama.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16, max_seq_len=SEQ)
    model = llama.Llama(args).to(torch.bfloat16)
    if fp8:
        convert_to_fp8(model, recipe="rowwise", module_filter_fn=llama.fp8_module_filter)
        n_fp8 = sum(isinstance(p, Fp8MasterWeight) for p in model.parameters())
        assert n_fp8 == 7 * args.n_layers, n_fp8
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    batches = data.RandomWindows(train_bytes, BATCH, SEQ, seed=seed)  # same batches for both runs
    losses = []
    for step in range(STEPS):
        warm = min(1.0, (step + 1) / 20)
        cos = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / STEPS))
        for group in opt.param_groups:
            group["lr"] = LR * warm * cos
        x, y = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        assert torch.isfinite(loss), f"{'fp8' if fp8 else 'bf16'} loss is {loss.item()} at step {step}"
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        val = sum(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item() for x, y in val_batches)
    return losses, val / len(val_batches)


@pytest.fixture
def one_thread():
    """The model is tiny: intra-op threads only add synchronization (and collapse on a busy 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_fp8_rowwise_loss_matches_bf16(_fresh_seed, one_thread):
    corpus = data.load_corpus(max_bytes=1 << 20)
    train_bytes, val_bytes = data.split_corpus(corpus)
    val_batches = data.fixed_windows(val_bytes, num_batches=4, batch_size=16, seq_len=SEQ)
    tail = lambda ls: sum(ls[-20:]) / 20  # noqa: E731
    val_gaps, tail_gaps = [], []
    # torch 2.11's CPU torch._scaled_mm (tensor-wise only there) takes about 1000 s per fp8 run of this test, 2.12 and
    # later's about 10 s: on 2.11 the fp8 GEMMs run emulated (the same quantized operands, multiplied in float32)
    old_cpu_gemm = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12)
    for seed in (_fresh_seed + i for i in range(3)):
        losses_bf16, val_bf16 = _train(False, train_bytes, val_batches, seed)
        with fp8tensor.config(gemm_backend="emulated" if old_cpu_gemm else "auto"):
            losses_fp8, val_fp8 = _train(True, train_bytes, val_batches, seed)
        print(f"seed {seed}: final val loss bf16 {val_bf16:.4f}  fp8 {val_fp8:.4f}  "
              f"gap {(val_fp8 - val_bf16) / val_bf16:+.3%}")
        # the model did learn (uniform over bytes is ln 256 = 5.55), so parity is not trivially met
        assert losses_bf16[0] > 4.5 and val_bf16 < 3.3, (seed, losses_bf16[0], val_bf16)
        assert all(math.isfinite(v) for v in losses_fp8 + losses_bf16), seed
        val_gaps.append(abs(val_fp8 - val_bf16) / val_bf16)
        tail_gaps.append(abs(tail(losses_fp8) - tail(losses_bf16)) / tail(losses_bf16))
    assert sum(val_gaps) / 3 <= 0.01, val_gaps
    assert sum(tail_gaps) / 3 <= 0.01, tail_gaps
