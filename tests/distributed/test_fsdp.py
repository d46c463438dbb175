"""FSDP2 + fp8tensor: fp8 all-gather of row-wise data and scales (``fp8tensor.fsdp``).

Real gloo processes, few spawns with many checks each: 2 ranks (every dim 0 divisible), 3 ranks (uneven shards,
both all-gather modes in one group) and 4 ranks (a 2 x 2 ``dp x tp`` mesh, and empty shards on a 1-D mesh of 4).
The workers *measure* (errors, equalities, payloads) and write what they measured to a file per rank; the tests
below assert on it, so each property is reported on its own.

References (every rank computes them on one device, for every rank's batch):

* ``fold`` — FSDP's fp8 path on one device: each Linear quantizes its full high-precision weight row-wise
  (``ScaledFp8Tensor.from_hp``), runs ``fp8_linear`` on it (scale folding for grad_input) and the per-rank weight
  gradients are averaged, as FSDP2's reduce-scatter does. FSDP must match it up to float32 summation order.
* ``master`` — the non-FSDP fp8 model (``convert_to_fp8``), same data: grad_input re-quantizes the master per
  column instead of folding, so it matches within fp8 rounding only.
* ``f64`` — the high-precision block in float64: the accuracy reference, bound derived from e4m3 rounding.

Data, weights and the random seed are fresh on every run (the parent draws the seed, or replays
printed on failure).
"""
from __future__ import annotations

import copy
import re
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
from conftest import same_fp8  # noqa: E402

# e4m3 has 3 mantissa bits: relative rounding 2^-4; a GEMM of Gaussian data ends up ~3.6% off in norm. One bound
# for "one fp8 GEMM away from float64"; the block output carries the residual, so it is well inside it.
FP8_BOUND = 5e-2
# The block against float64, per step from the same parameters: each residual branch is two fp8 GEMMs in series
# (wv -> wo, w1/w3 -> w2), so the output may be two GEMM errors off; a weight gradient of the first GEMMs goes
# through up to four (forward activation, grad_input of wo / w2, its own grad_weight), hence 4x.
BLOCK_OUT_BOUND = 2 * FP8_BOUND
BLOCK_GRAD_BOUND = 4 * FP8_BOUND
# FSDP vs the ``fold`` reference: the same fp8 numerics; only float32 summation order differs (the gradient
# average over ranks, DTensor partial sums). Step 0: gradients to float32 rounding. Later steps: parameters
# differing in the last bit can flip single fp8 roundings (each ~1e-3 of the output norm here), still far
# below any fp8-level discrepancy (> 3e-2) that a wrong row, scale or reduction would cause. The weight gradients of
# the first GEMMs (wq / wk / wv) collect the most flips: up to 1.8% relative after two steps (seed 57576644).
TIGHT = 1e-5
TIGHT_AFTER_STEP = 2.5e-2
# dp x tp at step 0: the tp ranks' partial sums of grad_input (an all-reduce) may differ from the fold reference's in
# the last bit already, and a last-bit difference can flip single fp8 roundings of the next GEMM's grad_out (each
# ~1e-3 of a gradient's norm here; FP8TENSOR_TEST_SEED=779802018 (spawned workers): 5.8e-4 on one weight gradient),
# still far below an fp8-level discrepancy (> 3e-2).
TIGHT_2D_GRAD = 3e-3
LR, STEPS = 1e-2, 3


# ============================================================================================ spawn harness
def spawn(fn_name: str, world: int, out_dir) -> list[dict]:
    """Run ``fn_name(rank, world, seed)`` on ``world`` gloo processes (``tests/distributed/_spawn.py``)."""
    from _spawn import spawn as run

    return run(__name__, fn_name, world, out_dir)


# ============================================================================================ helpers (workers)
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """Full high-precision value of a parameter / gradient (DTensor gathered, master unwrapped), detached."""
    from fp8tensor import Fp8MasterWeight
    from fp8tensor.tensor import _is_dtensor

    if _is_dtensor(t):
        t = t.full_tensor()
    if isinstance(t, Fp8MasterWeight):
        t = t._data
    return t.detach().clone()


class FoldLinear(nn.Module):
    """One Linear on one device run exactly as FSDP's fp8 path (with ``n``-way tensor parallelism along ``dim``).

    The weight (a plain high-precision Parameter) is cut into ``torch.chunk(n, dim)`` pieces as TP ranks hold it;
    each piece is quantized row-wise (``ScaledFp8Tensor.from_hp``: what each rank's FSDP all-gather produces) and
    used as a leaf in ``fp8_linear`` (scale folding for grad_input). Column pieces' outputs are concatenated, row
    pieces' summed in rank order (DTensor's partial-sum all-reduce). :meth:`fold_grad` returns the weight gradient
    averaged over the batches run since the last call, as FSDP2's reduce-scatter averages over data-parallel ranks.
    """

    def __init__(self, lin: nn.Linear, n: int = 1, dim: int = 0):
        super().__init__()
        assert lin.bias is None, "FoldLinear: test helper for bias-free Linears"
        self.weight, self.n, self.dim = lin.weight, n, dim
        self._w8s: list = []

    def forward(self, x):
        from fp8tensor import ScaledFp8Tensor, fp8_linear

        w8s = [ScaledFp8Tensor.from_hp(c.contiguous()).requires_grad_()
               for c in torch.chunk(self.weight.detach(), self.n, self.dim)]
        self._w8s.append(w8s)
        if self.dim == 0:
            return torch.cat([fp8_linear(x, w) for w in w8s], dim=-1)
        xs = torch.split(x, [w.shape[1] for w in w8s], dim=-1)
        out = fp8_linear(xs[0], w8s[0])
        for xi, wi in zip(xs[1:], w8s[1:]):
            out = out + fp8_linear(xi, wi)
        return out

    def fold_grad(self, world: int) -> torch.Tensor:
        grads = [torch.cat([w.grad for w in w8s], dim=self.dim) for w8s in self._w8s]
        self._w8s.clear()
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        return total / world


def make_fold(model: nn.Module, n: int = 1, row_parallel=()) -> nn.Module:
    """Replace every Linear of ``model`` by a :class:`FoldLinear` (row-parallel cut for names in ``row_parallel``)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, FoldLinear(child, n, 1 if name in row_parallel else 0))
    return model


def train_reference(model, xs, gs, world, kind, steps=STEPS):
    """Data-parallel training on one device: per step, every rank's batch in turn, gradients averaged.

    Returns ``(outs[step][rank], grads[step][name], params[name])``.
    """
    from fp8tensor import dequantize

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    outs, grads = [], []
    for t in range(steps):
        outs.append([])
        for r in range(world):
            x, g = xs[t][r], gs[t][r]
            if kind == "f64":
                x, g = x.double(), g.double()
            y = model(x)
            y.backward(g)
            outs[t].append(y.detach().clone())
        folded = set()
        for mod in model.modules():
            if isinstance(mod, FoldLinear):
                mod.weight.grad = mod.fold_grad(world)
                folded.add(id(mod.weight))
        for p in model.parameters():
            if id(p) not in folded:
                p.grad.div_(world)
        grads.append({n: dequantize(p.grad).detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs, grads, {n: _plain(p) for n, p in model.named_parameters()}


def train_fsdp(model, xs, gs, rank, steps=STEPS, on_step=None):
    """Train the FSDP model on this rank's batches.

    Returns ``(outs[step], grads[step][name], params_before[step][name], final_params[name])``.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    outs, grads, before = [], [], []
    for t in range(steps):
        before.append({n: _plain(p) for n, p in model.named_parameters()})
        y = model(xs[t][rank])
        y.backward(gs[t][rank].to(y.dtype))
        outs.append(y.detach().clone())
        grads.append({n: _plain(p.grad) for n, p in model.named_parameters()})
        if on_step is not None:
            on_step(t)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs, grads, before, {n: _plain(p) for n, p in model.named_parameters()}


def float64_errors(base, run, xs, gs, world, rank) -> dict:
    """Per step, the FSDP output / gradients against float64 from the *same* parameters (every rank's batch,
    gradients averaged): the fp8 error of each step, without the divergence of the trajectories."""
    outs, grads, before, _ = run
    m64 = copy.deepcopy(base).double()
    res = {"out": [], "grad": []}
    for t, params in enumerate(before):
        with torch.no_grad():
            for n, p in m64.named_parameters():
                p.copy_(params[n])
        y_rank = None
        for r in range(world):
            y = m64(xs[t][r].double())
            y.backward(gs[t][r].double())
            if r == rank:
                y_rank = y.detach()
        res["out"].append(rel(outs[t], y_rank))
        res["grad"].append({n: rel(grads[t][n], p.grad / world) for n, p in m64.named_parameters()})
        m64.zero_grad(set_to_none=True)
    return res


def compare_runs(run, ref, rank, steps=STEPS) -> dict:
    """FSDP run against a one-device reference run: per-step output / gradient and final parameter errors."""
    f_out, f_grads, _, f_params = run
    r_out, r_grads, r_params = ref
    return {
        "out": [rel(f_out[t], r_out[t][rank]) for t in range(steps)],
        "grad": [{n: rel(f_grads[t][n], r_grads[t][n]) for n in r_grads[t]} for t in range(steps)],
        "param": {n: rel(f_params[n], r_params[n]) for n in r_params},
        "out_equal0": bool(torch.equal(f_out[0].to(r_out[0][rank].dtype), r_out[0][rank])),
    }


def shard_block(block, mesh, *, reshard=True, mp=None):
    """``fully_shard`` the attention, the MLP and the block itself (three FSDP2 groups; the root holds the norms)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = dict(mesh=mesh, reshard_after_forward=reshard, mp_policy=mp or MixedPrecisionPolicy())
    fully_shard(block.attention, **kw)
    fully_shard(block.feed_forward, **kw)
    fully_shard(block, **kw)
    return block


def spy_all_gather(log: list):
    """An FSDP2 custom all-gather that logs ``(dtype, numel)`` of each all-gather input, then runs the default."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class _Spy(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            log.append((str(input_tensor.dtype), input_tensor.numel()))
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return _Spy()


def capture_forward_weights(model, store: dict):
    """Forward pre-hooks storing, per Linear, ``(type name, copy of the weight)`` the forward sees (of a DTensor:
    its local tensor). A copy because FSDP2 frees the unsharded parameter's storage when it reshards."""
    from fp8tensor.tensor import _is_dtensor

    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):

            def hook(m, args, _name=name):
                w = m.weight
                store[_name] = (type(w).__name__, (w.to_local() if _is_dtensor(w) else w).detach().clone())

            handles.append(mod.register_forward_pre_hook(hook))
    return handles


def make_data(seed, world, steps, shape):
    """Per-step, per-rank inputs and output cotangents (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [[torch.randn(*shape, generator=gen) for _ in range(world)] for _ in range(steps)]
    gs = [[torch.randn(*shape, generator=gen) for _ in range(world)] for _ in range(steps)]
    return xs, gs


def local_types(model) -> list:
    return sorted({type(p.to_local()).__name__ for p in model.parameters() if p.dim() == 2})


# ============================================================================================ 1-D worker (2 and 3 ranks)
def worker_1d(rank: int, world: int, seed: int) -> dict:
    """FSDP2 over a 1-D mesh of ``world`` ranks: the Llama block trained 3 AdamW steps in several setups."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fp8tensor.fsdp as f8fsdp
    import fp8tensor.fsdp_state as f8state
    from _llama_block import BlockConfig, LlamaBlock
    from fp8tensor import ScaledFp8Tensor, convert_to_fp8, quantize_weights

    res: dict = {"seed": seed}
    mesh = init_device_mesh("cpu", (world,))
    # hidden 64: wq/wk/wv/wo/w2 have 64 rows (22/22/20 over 3 ranks), w1/w3 96 (even over 2 and 3)
    cfg = BlockConfig(n_heads=4, head_dim=16, ffn=96)
    torch.manual_seed(seed)
    base = LlamaBlock(cfg)
    xs, gs = make_data(seed, world, STEPS, (2, 8, cfg.hidden))
    ref_fold = train_reference(make_fold(copy.deepcopy(base)), xs, gs, world, "fold")
    ref_master = train_reference(convert_to_fp8(copy.deepcopy(base)), xs, gs, world, "master", steps=1)

    # ---------------------------------------------- A: fp32, reshard after forward, convert_to_fp8 before fully_shard
    m = shard_block(convert_to_fp8(copy.deepcopy(base)), mesh)
    ag_log: list = []
    for mod in (m.attention, m.feed_forward, m):
        mod.set_custom_all_gather(spy_all_gather(ag_log))
    side_log: list = []
    orig_side = f8fsdp.gather_scales

    def spy_side(out, inp, group):
        side_log.append((str(inp.dtype), inp.numel()))
        return orig_side(out, inp, group)

    pre_log: list = []
    orig_pre = f8fsdp.master_pre_all_gather

    def spy_pre(master, mesh_, outer_size, *a):
        inputs, meta = orig_pre(master, mesh_, outer_size, *a)
        shard = master._data
        exp = ScaledFp8Tensor.from_hp(shard) if shard.numel() else None
        pre_log.append(dict(
            outer=tuple(outer_size), local_rows=shard.shape[0], mode=meta.mode, float8=str(meta.float8_dtype),
            inputs=[(str(t.dtype), tuple(t.shape)) for t in inputs],
            data_exact=exp is None or torch.equal(inputs[0][: shard.shape[0]], exp.qdata.view(torch.uint8)),
            scale_exact=exp is None or torch.equal((inputs[1] if len(inputs) > 1 else meta.scale.view(world, -1, 1)[rank])[: shard.shape[0]], exp.scale),
        ))
        return inputs, meta

    fwd_w: dict = {}
    handles = capture_forward_weights(m, fwd_w)
    step0: dict = {}
    f8fsdp.gather_scales, f8fsdp.master_pre_all_gather = spy_side, spy_pre
    try:
        run_a = train_fsdp(m, xs, gs, rank, on_step=lambda t: step0.update(fwd_w) if t == 0 else None)
    finally:
        f8fsdp.gather_scales, f8fsdp.master_pre_all_gather = orig_side, orig_pre
    for h in handles:
        h.remove()
    res["A_fold"] = compare_runs(run_a, ref_fold, rank)
    res["A_master"] = compare_runs(run_a, ref_master, rank, steps=1)
    res["A_f64"] = float64_errors(base, run_a, xs, gs, world, rank)
    res["A_local_types"] = local_types(m)
    full0 = run_a[2][0]
    res["A_forward_weights"] = {
        name: dict(type=tname, dtype=str(w.dtype), float8=str(getattr(w, "float8_dtype", None)),
                   exact=same_fp8(w, ScaledFp8Tensor.from_hp(full0[name + ".weight"])))
        for name, (tname, w) in step0.items()
    }
    n_unshard = len(pre_log) // 7  # 7 Linears per unshard of the whole block
    res["A_pre_log"] = pre_log[:7]
    res["A_n_pre"] = len(pre_log)
    res["A_allgather_log"] = ag_log
    res["A_side_log"] = side_log
    res["A_n_unshards"] = n_unshard
    res["shapes"] = {n: tuple(p.shape) for n, p in base.named_parameters()}
    del m

    # ---------------------------------------------- G: torch.compile-d sub-modules (compiled before fully_shard, as
    # a user does), reshard after forward: the re-gather before backward refills tensors the compiled graph saved
    from torch import _dynamo

    _dynamo.reset()
    m = convert_to_fp8(copy.deepcopy(base))
    m.attention.compile(backend="aot_eager")
    m.feed_forward.compile(backend="aot_eager")
    m = shard_block(m, mesh)
    try:
        run_g = train_fsdp(m, xs, gs, rank)
        eager = ([{rank: o} for o in run_a[0]], run_a[1], run_a[3])  # the eager FSDP run A, as a reference
        res["G_compiled"] = compare_runs(run_g, eager, rank)
        res["G_error"] = None
    except Exception as e:  # reported, so the test shows the error instead of a crashed worker
        res["G_error"] = f"{type(e).__name__}: {e}"
    del m
    _dynamo.reset()

    # ---------------------------------------------- B: bf16 params / fp32 reduce, no reshard after forward
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = shard_block(convert_to_fp8(copy.deepcopy(base)), mesh, reshard=False, mp=mp)
    fwd_w = {}
    handles = capture_forward_weights(m, fwd_w)
    fp = f8state.find_fsdp_param(m.feed_forward.w2.weight)
    ids, seen, grad_dtypes = [], [], []

    def on_step_b(t):
        ids.append(id(fp._unsharded_param))
        seen.append(sorted({(v[0], str(v[1].dtype)) for v in fwd_w.values()}))
        grad_dtypes.append(sorted({str(p.grad.dtype) for p in m.parameters()}))

    run_b = train_fsdp(m, xs, gs, rank, on_step=on_step_b)
    for h in handles:
        h.remove()
    res["B_f64"] = float64_errors(base, run_b, xs, gs, world, rank)
    res["B_unsharded_param_reused"] = len(set(ids)) == 1 and len(ids) == STEPS
    res["B_forward_types"] = seen
    res["B_grad_dtypes"] = grad_dtypes
    res["B_out_dtype"] = str(run_b[0][0].dtype)
    res["B_local_types"] = local_types(m)
    del m

    # ---------------------------------------------- C: convert_to_fp8 after fully_shard and after a first step
    m = shard_block(copy.deepcopy(base), mesh)
    m(xs[0][rank]).backward(gs[0][rank])  # FSDP2 lazily initialized, all-gather buffers sized for fp32 inputs
    m.zero_grad(set_to_none=True)
    convert_to_fp8(m)
    res["C_local_types"] = local_types(m)
    fwd_w = {}
    handles = capture_forward_weights(m, fwd_w)
    run_c = train_fsdp(m, xs, gs, rank)
    for h in handles:
        h.remove()
    res["C_forward_types"] = sorted({v[0] for v in fwd_w.values()})
    res["C_outputs_equal_A"] = all(torch.equal(a, c) for a, c in zip(run_a[0], run_c[0]))
    res["C_params_equal_A"] = all(torch.equal(run_a[3][n], run_c[3][n]) for n in run_a[3])
    del m
    # converting while FSDP2 holds the parameters unsharded (after a forward with reshard_after_forward=False) is
    # refused before anything changes; after reshard() it works
    m = shard_block(copy.deepcopy(base), mesh, reshard=False)
    m(xs[0][rank])
    before = {n: type(p) for n, p in m.named_parameters()}
    try:
        convert_to_fp8(m)
        res["C_unsharded_error"] = None
    except RuntimeError as e:
        res["C_unsharded_error"] = str(e)
    res["C_unsharded_unchanged"] = {n: type(p) for n, p in m.named_parameters()} == before
    for mod in (m.attention, m.feed_forward, m):
        mod.reshard()
    convert_to_fp8(m)
    res["C_after_reshard_types"] = local_types(m)
    del m

    # ---------------------------------------------- D: frozen ScaledFp8Tensor weights, quantized before / after
    plain_q = quantize_weights(copy.deepcopy(base))
    with torch.no_grad():
        y_ref = plain_q(xs[0][rank])
    full_w = {n: p.detach() for n, p in base.named_parameters()}
    for order in ("before", "after"):
        mq = copy.deepcopy(base)
        if order == "before":
            quantize_weights(mq)
        shard_block(mq, mesh)
        if order == "after":
            quantize_weights(mq)
        fwd_w = {}
        handles = capture_forward_weights(mq, fwd_w)
        with torch.no_grad():
            yq = mq(xs[0][rank])
        for h in handles:
            h.remove()
        # FSDP2's flat copy of each shard (unused by the fp8 all-gather) must not hold one scale per element
        flat_scale_bytes = max(
            f._sharded_param_data.scale.numel() * 4 for f in f8state._fsdp_params(mq) if f.sharded_param.dim() == 2)
        res[f"D_{order}"] = dict(
            local=local_types(mq),
            flat_scale_bytes=flat_scale_bytes,
            max_scale_bytes=max(4 * -(-s[0] // world) for s in (p.shape for p in base.parameters() if p.dim() == 2)),
            exact={n: same_fp8(w, ScaledFp8Tensor.from_hp(full_w[n + ".weight"])) for n, (_, w) in fwd_w.items()},
            out_equal=bool(torch.equal(yq, y_ref)),
        )
        del mq

    # ---------------------------------------------- E: one big weight, uneven over 3 ranks ([4096, 1024])
    rows, cols = (4096, 1024) if world == 3 else (80, 64)
    torch.manual_seed(seed + 7)
    lin = nn.Linear(cols, rows, bias=False)
    exp = ScaledFp8Tensor.from_hp(lin.weight.detach())
    for kind in ("master", "scaled"):
        mod = nn.Sequential(copy.deepcopy(lin))
        (convert_to_fp8 if kind == "master" else quantize_weights)(mod)
        fully_shard(mod, mesh=mesh)
        local_rows = mod[0].weight.to_local().shape[0]
        mod.unshard()
        w = mod[0].weight
        res[f"E_{kind}"] = dict(shape=(rows, cols), local_rows=local_rows, type=type(w).__name__, exact=same_fp8(w, exp))
        mod.reshard()
        del mod, w
    return res


# ============================================================================================ 4-rank worker
class CommLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Logs ``(op, dtype, shape)`` of every collective (``c10d`` / ``_c10d_functional`` op) run under it."""

    def __init__(self):
        super().__init__()
        self.log: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
            if isinstance(first, torch.Tensor):
                self.log.append((func.__name__, str(first.dtype), tuple(first.shape)))
        return func(*args, **(kwargs or {}))


def build_2d(base, mesh, order: str):
    """Apply, in ``order``: c = convert_to_fp8, t = parallelize_module over ``tp``, f = fully_shard over ``dp``."""
    from torch.distributed.tensor.parallel import parallelize_module

    from _llama_block import tp_plan
    from fp8tensor import convert_to_fp8

    m = copy.deepcopy(base)
    for step in order:
        if step == "c":
            convert_to_fp8(m)
        elif step == "t":
            parallelize_module(m, mesh["tp"], tp_plan(False))
        elif step == "f":
            shard_block(m, mesh["dp"])
    return m


def worker_4(rank: int, world: int, seed: int) -> dict:
    """2 x 2 (dp x tp): FSDP2 over dp + tensor parallelism over tp, every conversion order. Then empty shards:
    a [2, 64] weight on a 1-D mesh of 4."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from _llama_block import BlockConfig, LlamaBlock
    from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor, quantize_weights
    from fp8tensor.convert import fp8_linear_forward
    from fp8tensor.recipes import get_recipe

    res: dict = {"seed": seed}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    cfg = BlockConfig(n_heads=4, head_dim=16, ffn=96)
    torch.manual_seed(seed)
    base = LlamaBlock(cfg)
    xs, gs = make_data(seed, 2, STEPS, (2, 8, cfg.hidden))
    ref_fold = train_reference(make_fold(copy.deepcopy(base), 2, ("wo", "w2")), xs, gs, 2, "fold")

    # collectives of a high-precision FSDP2 + TP forward: the baseline
    hp = build_2d(base, mesh, "tf")
    with CommLog() as hp_comm:
        hp(xs[0][dp])
    hp.reshard()
    res["hp_reduce_ops"] = [c for c in hp_comm.log if "reduce" in c[0]]
    del hp

    for i, order in enumerate(("ctf", "tcf", "tfc")):
        steps = STEPS if i == 0 else 1
        m = build_2d(base, mesh, order)
        out: dict = {"local_types": local_types(m)}
        fwd_w: dict = {}
        handles = capture_forward_weights(m, fwd_w)
        comm = CommLog()
        with comm:
            m(xs[0][dp])
        m.reshard()
        m.zero_grad(set_to_none=True)
        out["reduce_ops"] = [c for c in comm.log if "reduce" in c[0]]
        out["forward"] = sorted({(v[0], type(v[1]).__name__) for v in fwd_w.values()})
        run = train_fsdp(m, xs, gs, dp, steps=steps)
        for h in handles:
            h.remove()
        out["fold"] = compare_runs(run, ([o for o in ref_fold[0]], ref_fold[1], ref_fold[2]), dp, steps=steps)
        if steps < STEPS:
            out["fold"]["param"] = {}
        out["f64"] = float64_errors(base, run, xs, gs, 2, dp)
        out["local_types_after"] = local_types(m)
        res[order] = out
        del m

    # ---------------------------------------------- empty shards: [2, 64] over 4 ranks
    mesh4 = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed + 11)
    lin = nn.Linear(64, 2, bias=False)
    w_full = lin.weight.detach().clone()
    exp = ScaledFp8Tensor.from_hp(w_full)
    gen = torch.Generator().manual_seed(seed + 12)
    x, g = torch.randn(3, 64, generator=gen), torch.randn(3, 2, generator=gen)
    for kind in ("master", "scaled"):
        mod = nn.Sequential(copy.deepcopy(lin))
        if kind == "master":  # convert_to_fp8 leaves dims that are not multiples of 16 alone: wrap by hand
            mod[0].weight = nn.Parameter(Fp8MasterWeight(mod[0].weight.detach().clone()))
            mod[0].fp8_recipe = get_recipe("rowwise")
            mod[0].forward = types.MethodType(fp8_linear_forward, mod[0])
        else:
            quantize_weights(mod)
        fully_shard(mod, mesh=mesh4)
        entry = {"local_rows": mod[0].weight.to_local().shape[0]}
        mod.unshard()
        w = mod[0].weight
        entry["type"], entry["exact"] = type(w).__name__, same_fp8(w, exp)
        mod.reshard()
        del w
        if kind == "master":
            # one training step against the one-device fold reference with the same AdamW step
            ref = nn.Sequential(FoldLinear(nn.Linear(64, 2, bias=False)))
            with torch.no_grad():
                ref[0].weight.copy_(w_full)
            y_ref = ref(x)
            y_ref.backward(g)
            ref[0].weight.grad = ref[0].fold_grad(1)
            torch.optim.AdamW(ref.parameters(), lr=LR).step()
            opt = torch.optim.AdamW(mod.parameters(), lr=LR)
            y = mod(x)
            y.backward(g)
            entry["out_equal"] = bool(torch.equal(y, y_ref))
            entry["grad_rel"] = rel(_plain(mod[0].weight.grad), ref[0].weight.grad)
            opt.step()
            entry["param_rel"] = rel(_plain(mod[0].weight), ref[0].weight.detach())
        res[f"empty_{kind}"] = entry
        del mod

    # ---------------------------------------------- a 1-rank shard mesh (FSDP2 copies only the first input)
    one = init_device_mesh("cpu", (world, 1), mesh_dim_names=("x", "one"))["one"]
    torch.manual_seed(seed + 13)
    lin = nn.Linear(64, 32, bias=False)
    exp = ScaledFp8Tensor.from_hp(lin.weight.detach())
    mod = nn.Sequential(copy.deepcopy(lin))
    from fp8tensor import convert_to_fp8

    convert_to_fp8(mod)
    fully_shard(mod, mesh=one)
    outs = []
    for _ in range(2):  # the second iteration refills the unsharded parameter (out=)
        y = mod(x)
        y.backward(torch.ones_like(y))
        outs.append(y.detach())
    mod.unshard()
    ref = FoldLinear(copy.deepcopy(lin))
    res["world1"] = dict(exact=same_fp8(mod[0].weight, exp), out_equal=all(torch.equal(o, ref(x)) for o in outs))
    mod.reshard()
    return res


# ============================================================================================ fixtures
@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    return spawn("worker_1d", 2, tmp_path_factory.mktemp("fsdp2"))


@pytest.fixture(scope="module")
def run3(tmp_path_factory):
    return spawn("worker_1d", 3, tmp_path_factory.mktemp("fsdp3"))


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    return spawn("worker_4", 4, tmp_path_factory.mktemp("fsdp4"))


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks_uneven"])
def run1d(request):
    return request.getfixturevalue(f"run{request.param}")


def _ctx(r: dict) -> str:
    return f"(seed {r['seed']})"


# ============================================================================================ tests: 1-D
def test_forward_weight_is_exact_fp8(run1d):
    """The forward sees a ScaledFp8Tensor with the bits and scales of quantizing the full master weight."""
    for rank, r in enumerate(run1d):
        fw = r["A_forward_weights"]
        assert len(fw) == 7, fw
        for name, w in fw.items():
            assert w["type"] == "ScaledFp8Tensor" and w["float8"] == "torch.float8_e4m3fn", (rank, name, w)
            assert w["dtype"] == "torch.float32", (rank, name, w)
            assert w["exact"], f"rank {rank} {name}: gathered fp8 weight differs from from_hp(full) {_ctx(r)}"
        assert r["A_local_types"] == ["Fp8MasterWeight"]


def test_all_gather_payload_is_fp8(run1d):
    """What goes over the wire: fp8 bytes + float32 row scales, (K + 4) bytes per row instead of 2K for bf16."""
    world = len(run1d)
    for rank, r in enumerate(run1d):
        shapes = r["shapes"]
        linears = {n: s for n, s in shapes.items() if len(s) == 2}
        norms = {n: s for n, s in shapes.items() if len(s) == 1}
        pre = r["A_pre_log"]
        assert len(pre) == 7 and r["A_n_pre"] == 7 * r["A_n_unshards"]
        expect_fp8_bytes = side_bytes = 0
        for p in pre:
            rows, k = p["outer"]
            prow = -(-rows // world)
            assert p["float8"] == "torch.float8_e4m3fn" and p["data_exact"] and p["scale_exact"], p
            if rows % world == 0:
                assert p["mode"] == "fused", p
                assert p["inputs"] == [("torch.uint8", (prow, k)), ("torch.float32", (prow, 1))], p
            else:
                assert p["mode"] == "padded", p
                assert p["inputs"] == [("torch.uint8", (prow, k))], p
                side_bytes += 4 * prow
            expect_fp8_bytes += prow * k + 4 * prow
        # every all-gather of a group holding fp8 weights is one uint8 collective; the root's norms stay float32
        per_unshard = r["A_allgather_log"][:3]
        fp8_colls = [n for d, n in per_unshard if d == "torch.uint8"]
        hp_colls = [n for d, n in per_unshard if d == "torch.float32"]
        assert len(fp8_colls) == 2 and hp_colls == [sum(-(-s[0] // world) for s in norms.values())], per_unshard
        sent = sum(fp8_colls) + sum(n * 4 for d, n in r["A_side_log"][: len(r["A_side_log"]) // r["A_n_unshards"]])
        assert all(d == "torch.float32" for d, _ in r["A_side_log"])
        assert sent == expect_fp8_bytes, (sent, expect_fp8_bytes)
        bf16_bytes = sum(2 * -(-s[0] // world) * s[1] for s in linears.values())
        ratio = sent / bf16_bytes
        # (K + 4) / 2K with K = 64 and 96: 0.53 / 0.52
        assert ratio <= max((s[1] + 4) / (2 * s[1]) for s in linears.values()) + 1e-9, ratio


def test_training_matches_fold_reference(run1d):
    """Forward, backward and 3 AdamW steps equal the one-device model that quantizes the full weight row-wise
    (what the all-gather delivers) up to float32 summation order."""
    for rank, r in enumerate(run1d):
        c = r["A_fold"]
        assert c["out_equal0"], f"rank {rank}: step-0 output not bit-identical {_ctx(r)}"
        assert max(c["grad"][0].values()) < TIGHT, (rank, c["grad"][0], _ctx(r))
        for t in range(1, STEPS):
            assert c["out"][t] < TIGHT_AFTER_STEP and max(c["grad"][t].values()) < TIGHT_AFTER_STEP, (rank, t, c)
        assert max(c["param"].values()) < TIGHT_AFTER_STEP, (rank, c["param"], _ctx(r))


def test_matches_non_fsdp_fp8_model(run1d):
    """Against convert_to_fp8 without FSDP: same forward bits; gradients differ by fp8 rounding only (the
    non-FSDP grad_input re-quantizes the master per column, FSDP folds the row scales)."""
    for rank, r in enumerate(run1d):
        c = r["A_master"]
        assert c["out_equal0"], (rank, c["out"], _ctx(r))
        assert max(c["grad"][0].values()) < BLOCK_GRAD_BOUND, (rank, c["grad"][0], _ctx(r))


@pytest.mark.parametrize("run", ["A_f64", "B_f64"], ids=["fp32", "bf16_params"])
def test_accuracy_vs_float64(run1d, run):
    """Each step's output and gradients, from the same parameters, against float64: fp8-level errors."""
    for rank, r in enumerate(run1d):
        e = r[run]
        assert max(e["out"]) < BLOCK_OUT_BOUND, (rank, e["out"], _ctx(r))
        for t in range(STEPS):
            assert max(e["grad"][t].values()) < BLOCK_GRAD_BOUND, (rank, t, e["grad"][t], _ctx(r))


def test_compiled_matches_eager(run1d):
    """Sub-modules compiled (aot_eager) before fully_shard, reshard after forward: the later all-gathers refill
    the unsharded fp8 weight the compiled graph saved for backward (no in-place version error), and 3 AdamW
    steps match the eager FSDP run."""
    for rank, r in enumerate(run1d):
        assert r["G_error"] is None, r["G_error"]
        c = r["G_compiled"]
        assert max(c["out"]) < TIGHT_AFTER_STEP and c["out"][0] < TIGHT, (rank, c["out"], _ctx(r))
        assert max(c["grad"][0].values()) < TIGHT, (rank, c["grad"][0], _ctx(r))
        for t in range(STEPS):
            assert max(c["grad"][t].values()) < TIGHT_AFTER_STEP, (rank, t, c["grad"][t], _ctx(r))
        assert max(c["param"].values()) < TIGHT_AFTER_STEP, (rank, c["param"], _ctx(r))


def test_mixed_precision_no_reshard_after_forward(run1d):
    """MixedPrecisionPolicy(bf16 params, fp32 reduce) with reshard_after_forward=False: the forward weight is an
    fp8 tensor reading as bf16, gradients reach the fp32 master in fp32, and later iterations refill the same
    unsharded parameter (``out=``)."""
    for rank, r in enumerate(run1d):
        assert r["B_out_dtype"] == "torch.bfloat16"
        assert all(s == [("ScaledFp8Tensor", "torch.bfloat16")] for s in r["B_forward_types"]), r["B_forward_types"]
        assert all(d == ["torch.float32"] for d in r["B_grad_dtypes"]), r["B_grad_dtypes"]
        assert r["B_unsharded_param_reused"]
        assert r["B_local_types"] == ["Fp8MasterWeight"]


def test_convert_after_fully_shard(run1d):
    """convert_to_fp8 on an FSDP2 model that already ran a high-precision step: FSDP2 picks the fp8 all-gather up
    and the run is bit-identical to converting before fully_shard. Converting parameters FSDP2 holds unsharded is
    refused with a clear error and no change."""
    for rank, r in enumerate(run1d):
        assert r["C_local_types"] == ["Fp8MasterWeight"]
        assert r["C_forward_types"] == ["ScaledFp8Tensor"]
        assert r["C_outputs_equal_A"] and r["C_params_equal_A"], _ctx(r)
        err = r["C_unsharded_error"]
        assert err and "convert_to_fp8" in err and "unsharded" in err and "reshard" in err, err
        assert re.search(r"parameter '(attention|feed_forward)\.\w+\.weight'", err), err  # its full name
        assert r["C_unsharded_unchanged"] and r["C_after_reshard_types"] == ["Fp8MasterWeight"]


def test_frozen_scaled_fp8_weights(run1d):
    """quantize_weights before or after fully_shard: data and scales gathered as stored, bit-exact forward, and
    no per-element scale copy left in FSDP2's bookkeeping."""
    for rank, r in enumerate(run1d):
        for order in ("before", "after"):
            d = r[f"D_{order}"]
            assert d["local"] == ["ScaledFp8Tensor"], (order, d)
            assert len(d["exact"]) == 7 and all(d["exact"].values()), (order, d["exact"])
            assert d["out_equal"], (rank, order, _ctx(r))
            assert d["flat_scale_bytes"] <= d["max_scale_bytes"], (order, d["flat_scale_bytes"])


def test_big_uneven_weight(run1d):
    """[4096, 1024] over 3 ranks (1366/1366/1364 rows), [80, 64] over 2: gathered weight bit-identical."""
    world = len(run1d)
    for rank, r in enumerate(run1d):
        for kind in ("master", "scaled"):
            e = r[f"E_{kind}"]
            rows = e["shape"][0]
            chunk = -(-rows // world)
            assert e["local_rows"] == min(chunk, max(rows - rank * chunk, 0)), e
            assert e["type"] == "ScaledFp8Tensor" and e["exact"], (rank, kind, e)


# ============================================================================================ tests: 4 ranks
@pytest.mark.parametrize("order", ["ctf", "tcf", "tfc"])
def test_2d_fsdp_tp(run4, order):
    """dp=2 x tp=2, convert_to_fp8 before TP, between TP and FSDP, after both: master shards stay
    Fp8MasterWeight, the forward weight is a DTensor of a ScaledFp8Tensor, training matches the one-device
    per-TP-shard fold reference, and the forward runs no collective that the high-precision one does not
    (no weight-scale all-reduce)."""
    for rank, r in enumerate(run4):
        o = r[order]
        assert o["local_types"] == ["Fp8MasterWeight"] and o["local_types_after"] == ["Fp8MasterWeight"], o
        assert o["forward"] == [("DTensor", "ScaledFp8Tensor")], o["forward"]
        assert o["reduce_ops"] == r["hp_reduce_ops"], (o["reduce_ops"], r["hp_reduce_ops"])
        c = o["fold"]
        assert c["out_equal0"], (rank, order, c["out"], _ctx(r))
        assert max(c["grad"][0].values()) < TIGHT_2D_GRAD, (rank, order, c["grad"][0], _ctx(r))
        for t in range(1, len(c["out"])):
            assert c["out"][t] < TIGHT_AFTER_STEP and max(c["grad"][t].values()) < TIGHT_AFTER_STEP, (rank, t, c)
        assert not c["param"] or max(c["param"].values()) < TIGHT_AFTER_STEP, c["param"]
        e = o["f64"]
        assert max(e["out"]) < BLOCK_OUT_BOUND, (rank, order, e["out"], _ctx(r))
        assert all(max(g.values()) < BLOCK_GRAD_BOUND for g in e["grad"]), (rank, order, e["grad"], _ctx(r))


def test_empty_shards(run4):
    """A [2, 64] weight over 4 ranks: ranks 2 and 3 hold no rows. Gather bit-identical, one training step equal
    to the one-device reference."""
    for rank, r in enumerate(run4):
        for kind in ("master", "scaled"):
            e = r[f"empty_{kind}"]
            assert e["local_rows"] == (1 if rank < 2 else 0), e
            assert e["type"] == "ScaledFp8Tensor" and e["exact"], (rank, kind, e)
        e = r["empty_master"]
        assert e["out_equal"] and e["grad_rel"] < TIGHT and e["param_rel"] < TIGHT, (rank, e, _ctx(r))


def test_world_size_one(run4):
    """FSDP2 over a 1-rank mesh (data through FSDP2, scales through the metadata): exact weight and forward."""
    for r in run4:
        assert r["world1"]["exact"] and r["world1"]["out_equal"], r["world1"]
