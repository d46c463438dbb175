"""A training step captured as one CUDA graph (``fp8tensor.graph_step``) trains as the eager step (skipped without a GPU).

For each supported configuration the same model (same seed) is trained twice on the same batches: eagerly, and with
forward + loss + backward captured once and replayed (optimizer outside the graph). AdamW's learning rate moves every
weight by several percent over the run, so a replay that read stale memory (an fp8 weight quantized before the
capture, a kernel argument table freed after it, gradients written where the optimizer does not look) changes the
losses. Attention runs the math backend (deterministic): the replays run the eager step's kernels, so the two runs
must be bit-identical.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

STEPS = 30


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "tp"))
    if own:
        dist.destroy_process_group()


def _build(cfg: dict, mesh):
    from llama import Llama, ModelArgs, fp8_module_filter, parallelize_llama
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import fp8tensor

    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = dict(moe=True, n_experts=4, top_k=2) if cfg.get("moe") else {}
        model = Llama(ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, max_seq_len=128, **moe))
    if not cfg["fsdp"]:
        model.to(torch.bfloat16)  # no FSDP2: bf16 parameters are the masters
    if cfg["recipe"] is not None:
        fp8tensor.convert_to_fp8(model, recipe=cfg["recipe"], module_filter_fn=fp8_module_filter,
                                 fp8_all_gather=cfg.get("fp8ag", True))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    parallelize_llama(model, mesh["tp"] if cfg["tp"] else None, mesh["dp"] if cfg["fsdp"] else None,
                      sequence_parallel=cfg["tp"], mp_policy=mp, reshard_after_forward=False,
                      compile=cfg["compile"], tp_on_one_rank=cfg["tp"])
    return model


def _learnable_batch(i: int, batch: int = 4, seq: int = 129) -> torch.Tensor:
    """Token sequences with a pattern the model learns within a few steps (counting up by a per-row stride from a
    random start), so the loss falls and the weights move."""
    gen = torch.Generator().manual_seed(i)
    start = torch.randint(0, 256, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    return ((start + stride * torch.arange(seq)) % 256).cuda()


def _train(cfg: dict, mesh, graphed: bool):
    """Losses of STEPS optimizer steps and the final full weights."""
    import fp8tensor

    torch._dynamo.reset()
    model = _build(cfg, mesh)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3, fused=True)
    accum, clip = cfg.get("accum", 1), cfg.get("clip")
    batches = [_learnable_batch(i) for i in range(STEPS * accum)]

    def fwd_bwd(tok):
        logits = model(tok[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten()) / accum
        loss.backward()
        if clip == "inside":
            torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
        return loss.detach()

    step = fp8tensor.graph_step(fwd_bwd, params, enabled=True) if graphed else fwd_bwd
    losses = []
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        for i in range(STEPS):
            total = 0.0
            for j in range(accum):
                total += float(step(batches[i * accum + j]))
            if clip == "after":
                torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=not graphed)
            losses.append(total)
    if graphed:
        assert step.captured and step.calls == STEPS * accum
        step.close()
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
               for n, p in model.named_parameters()}
    del model, opt
    torch._dynamo.reset()
    return losses, weights


CONFIGS = {
    # FSDP2 (1 rank; weights all-gathered in fp8, fp8ag=False: in bf16), compiled blocks, clipping after the graph
    "fsdp-compile-rowwise": dict(recipe="rowwise", fsdp=True, tp=False, compile=True, clip="after"),
    "fsdp-compile-rowwise-bf16-gather": dict(recipe="rowwise", fsdp=True, tp=False, compile=True, clip="after",
                                             fp8ag=False),
    "fsdp-compile-gw_hp": dict(recipe="rowwise_gw_hp", fsdp=True, tp=False, compile=True, clip="after"),
    # eager blocks, clipping inside the graph
    "fsdp-eager-rowwise-clip-inside": dict(recipe="rowwise", fsdp=True, tp=False, compile=False, clip="inside"),
    # gradient accumulation: 2 replays per optimizer step
    "fsdp-compile-rowwise-accum": dict(recipe="rowwise", fsdp=True, tp=False, compile=True, accum=2),
    # TP + SP on a DTensor mesh (1 rank), FSDP2, compiled blocks
    "tp-sp-fsdp-compile-rowwise": dict(recipe="rowwise", fsdp=True, tp=True, compile=True, clip="after"),
    # no FSDP2: bf16 parameters as masters
    "plain-eager-rowwise": dict(recipe="rowwise", fsdp=False, tp=False, compile=False),
    # the bf16 baseline itself
    "fsdp-compile-bf16": dict(recipe=None, fsdp=True, tp=False, compile=True, clip="after"),
    # mixture of experts: fp8 grouped experts (offsets on the device, no host sync), eager and inside compiled blocks
    "moe-fsdp-compile-rowwise": dict(recipe="rowwise", fsdp=True, tp=False, compile=True, clip="after", moe=True),
    "moe-plain-eager-rowwise": dict(recipe="rowwise", fsdp=False, tp=False, compile=False, moe=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_graphed_training_matches_eager(name, mesh):
    cfg = CONFIGS[name]
    l_eager, w_eager = _train(cfg, mesh, graphed=False)
    l_graph, w_graph = _train(cfg, mesh, graphed=True)
    # the weights moved: stale memory in a replay would show in the losses
    assert abs(l_eager[-1] - l_eager[0]) > 0.05 * abs(l_eager[0]), l_eager
    if cfg.get("moe"):
        # The MoE combines its experts' outputs with a float index_add_ (CUDA atomics: the summation order differs
        # from run to run, eager or graphed), so the runs agree to float rounding, not bit for bit: losses within
        # 1e-3 relative, weights within 1e-2 of their norm (a replay reading stale weights or offsets moves them by
        # the optimizer's several percent).
        for i, (a, b) in enumerate(zip(l_eager, l_graph)):
            assert abs(a - b) <= 1e-3 * abs(a), (i, a, b)
        for k in w_eager:
            err = float((w_graph[k] - w_eager[k]).norm() / w_eager[k].norm().clamp(min=1e-30))
            assert err <= 1e-2, (k, err)
        return
    # The replays run the kernels the eager step ran, on the same data: the same bits, losses and final weights.
    assert l_graph == l_eager, [(i, a, b) for i, (a, b) in enumerate(zip(l_eager, l_graph)) if a != b][:3]
    for k in w_eager:
        assert torch.equal(w_graph[k], w_eager[k]), (k, (w_graph[k] - w_eager[k]).abs().max().item())


def test_graph_errors(mesh):
    """Gradients set to None after the capture, changed input shapes and a host sync inside the step raise."""
    import fp8tensor

    cfg = dict(recipe="rowwise", fsdp=True, tp=False, compile=False)
    model = _build(cfg, mesh)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)

    def fwd_bwd(tok):
        loss = F.cross_entropy(model(tok[:, :-1]).flatten(0, 1).float(), tok[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    tok = torch.randint(0, 256, (2, 65), device="cuda")
    step = fp8tensor.graph_step(fwd_bwd, params, warmup_steps=1)
    for _ in range(3):
        step(tok)
        opt.step()
        opt.zero_grad(set_to_none=False)
    with pytest.raises(ValueError, match="graph_step: the inputs changed"):
        step(torch.randint(0, 256, (2, 33), device="cuda"))
    opt.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"set to None.*zero_grad\(set_to_none=False\)"):
        step(tok)
    step.close()

    del model, opt


_FAILING_CAPTURE = """
import torch, fp8tensor
w = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
def step(x):
    loss = (x @ w).square().mean()
    loss.backward()
    loss.item()  # a host synchronization inside the step
    return loss
s = fp8tensor.graph_step(step, [w], warmup_steps=1)
s(torch.randn(8, 64, device="cuda"))
try:
    s(torch.randn(8, 64, device="cuda"))
except RuntimeError as e:
    print("RAISED", str(e).splitlines()[0])
"""


def test_failed_capture_raises_a_clear_error():
    """A host synchronization inside the step makes the capture fail with graph_step's message (in a process of its
    own: a failed capture leaves PyTorch's CUDA random number generator unusable in that process)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", ".."),
                                                     os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _FAILING_CAPTURE], capture_output=True, text=True, env=env,
                         timeout=300)
    assert "RAISED graph_step: capturing the step as a CUDA graph failed" in out.stdout, (out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize("how", ["to", "data", "assign"])
def test_graph_refuses_parameters_moved_after_capture(how, mesh):
    """Parameters moved to new memory after the capture (``model.to``, ``p.data =``) or replaced in their modules
    (``load_state_dict(assign=True)``) raise at the next call before any replay; ``close()`` starts over on the
    current parameters, which then train (the replays of the test above pass the same check at every call)."""
    import fp8tensor

    model = _build(dict(recipe="rowwise", fsdp=False, tp=False, compile=False), mesh)
    params = list(model.parameters())

    def fwd_bwd(tok):
        loss = F.cross_entropy(model(tok[:, :-1]).flatten(0, 1).float(), tok[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    tok = torch.randint(0, 256, (2, 65), device="cuda")
    step = fp8tensor.graph_step(fwd_bwd, model, warmup_steps=1)  # the model: replacements in it are seen
    assert step.parameters == params
    for _ in range(3):
        step(tok)
    assert step.captured
    if how == "to":
        model.to(torch.float32)
    elif how == "data":
        w = model.output.weight
        w.data = w.data.clone()
    else:
        model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
    replays = step.calls
    with pytest.raises(RuntimeError, match=r"graph_step: .*(other memory|replaced in their modules).*close\(\)"):
        step(tok)
    assert step.calls == replays + 1 and step.captured  # refused before the replay
    step.close()
    assert {id(p) for p in step.parameters} == {id(p) for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    losses = [float(step(tok)) for _ in range(3)]
    assert all(map(lambda v: v == v, losses))
    del model
