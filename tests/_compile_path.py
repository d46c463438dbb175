"""What a compiled fp8 Linear must do on every torch: train through the autograd Function, never the export path.

On torch 2.11, ``torch.compiler.is_exporting()`` is True inside ``torch.compile``; an fp8 Linear that asked it ran the
export forward (outside the ``autograd.Function``) in every compiled region, and ``x.grad`` came out None. The checks
here fail if compile is ever taken for export again: a converted ``nn.Linear`` compiled vs the same Linear eager —
the gradients of the input, the weight and the bias exist and agree, and the Function's backward ran.

Used by ``tests/test_compile_path.py`` (CPU, ``aot_eager``) and ``tests/gpu/test_gpu_compile_path.py`` (inductor).
"""
from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import linear as _linear

#: Relative Frobenius error of a GEMM with both operands rounded to e4m3 (see ``conftest.E4M3_GEMM_BOUND``).
FP8_BOUND = 5e-2
#: Compiled vs eager on the same fp8 operands: inductor may fuse the quantizations into other kernels, so an amax or
#: a rounding can differ by an ulp (one fp8 rounding step flipped: ~1e-3 of the norm); a wrong path is fp8-level off.
COMPILED_VS_EAGER_BOUND = 1e-2


#: Calls of the fp8 Linear's backward seen at run time (see :class:`BackwardCounter`).
_CALLS = [0]


@torch.library.custom_op("fp8tensor_tests::count_backward", mutates_args=())
def _count_backward(grad: torch.Tensor) -> torch.Tensor:
    """Identity that counts its runs: an opaque op, so compiled graphs call it at run time, once per backward."""
    _CALLS[0] += 1
    return grad.clone()


@_count_backward.register_fake
def _(grad):
    return torch.empty_like(grad)


class BackwardCounter:
    """Counts runs of the fp8 Linear's ``autograd.Function`` backward (the training path), eager or compiled.

    The backward is patched to pass ``grad_out`` through an opaque custom op that counts its calls (a Python counter
    in the backward itself would be a side effect dynamo refuses, and dynamo inlines the Python code rather than
    calling it). A compiled region that ran the export forward instead has no such backward: the count stays 0."""

    def __init__(self, monkeypatch):
        orig = _linear._Fp8Linear.backward
        self._start = _CALLS[0]

        def counted(ctx, grad_out):
            from torch.distributed.tensor import DTensor

            if isinstance(grad_out, DTensor):  # (the op has no sharding rule: count on the local tensor)
                grad_out = DTensor.from_local(_count_backward(grad_out.to_local()), grad_out.device_mesh,
                                              grad_out.placements, shape=grad_out.shape, stride=grad_out.stride())
            else:
                grad_out = _count_backward(grad_out)
            return orig(ctx, grad_out)

        monkeypatch.setattr(_linear._Fp8Linear, "backward", staticmethod(counted))

    @property
    def calls(self) -> int:
        return _CALLS[0] - self._start


def make_linear(weights: str, recipe: str, device, dtype=torch.bfloat16, K=64, N=48) -> nn.Module:
    """A converted ``nn.Linear(K, N)`` with bias: ``weights="master"`` (convert_to_fp8: a trainable master) or
    ``"fp8"`` (quantize_weights: the weight stored in fp8, frozen; the bias trains)."""
    lin = nn.Linear(K, N, device=device, dtype=dtype)
    lin.weight_hp = lin.weight.detach().clone()  # (a plain attribute: the float64 reference reads it)
    if weights == "master":
        fp8tensor.convert_to_fp8(lin, recipe=recipe)
    else:
        fp8tensor.quantize_weights(lin)
    return lin


def run(lin, x, gy):
    """``(y, x.grad, weight.grad, bias.grad)`` of one forward + backward."""
    x = x.detach().clone().requires_grad_(True)
    y = lin(x)
    y.backward(gy)
    w = lin.weight
    return y.detach(), x.grad, (w.grad if w.requires_grad else None), lin.bias.grad


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def check_compiled_matches_eager(monkeypatch, *, device, ndim, weights, recipe, fullgraph, backend, bit_exact):
    """The compiled Linear's output and gradients exist, agree with eager (to the bit if ``bit_exact``, else within
    :data:`COMPILED_VS_EAGER_BOUND`) and with float64 (fp8 bound), and the Function's backward ran."""
    torch._dynamo.reset()
    counter = BackwardCounter(monkeypatch)
    eager = make_linear(weights, recipe, device)
    comp = copy.deepcopy(eager)
    shape = (37, 64) if ndim == 2 else (3, 13, 64)
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    gy = torch.randn(*shape[:-1], 48, device=device, dtype=torch.bfloat16)
    ye, gxe, gwe, gbe = run(eager, x, gy)
    eager_calls = counter.calls
    assert eager_calls == 1, "the eager fp8 Linear did not run its autograd Function's backward"
    yc, gxc, gwc, gbc = run(torch.compile(comp, backend=backend, fullgraph=fullgraph), x, gy)
    assert counter.calls > eager_calls, (
        "the compiled fp8 Linear never ran the autograd Function's backward: compile was taken for export")
    assert gxc is not None, "compiled fp8 Linear: the input has no gradient (the export path ran)"
    assert gbc is not None, "compiled fp8 Linear: the bias has no gradient"
    if weights == "master":
        assert gwc is not None, "compiled fp8 Linear: the master weight has no gradient"
    else:
        assert gwc is None and gwe is None
    pairs = [("output", yc, ye), ("grad_input", gxc, gxe), ("grad_bias", gbc, gbe)]
    if gwe is not None:
        pairs.append(("grad_weight", gwc, gwe))
    for name, c, e in pairs:
        assert c.shape == e.shape and c.dtype == e.dtype, name
        if bit_exact:
            assert torch.equal(c, e), f"{name}: compiled differs from eager by {rel(c, e):.3g} (claimed bit-identical)"
        else:
            assert rel(c, e) < COMPILED_VS_EAGER_BOUND, f"{name}: compiled vs eager {rel(c, e):.3g}"
    # accuracy against float64 (fresh weights: read them back in high precision)
    wd = eager.weight_hp.double()
    xd, gyd = x.double().reshape(-1, 64), gy.double().reshape(-1, 48)
    assert rel(yc.reshape(-1, 48), xd @ wd.t() + eager.bias.detach().double()) < FP8_BOUND
    assert rel(gxc.reshape(-1, 64), gyd @ wd) < FP8_BOUND
    if gwc is not None:
        assert rel(gwc, gyd.t() @ xd) < FP8_BOUND


def check_compiled_tp_linear_trains(monkeypatch, mesh, style, *, device, backend):
    """A compiled tensor-parallel fp8 Linear (DTensor weight under ``ColwiseParallel`` / ``RowwiseParallel``, on a
    1-rank ``mesh``) runs the training path: the Function's backward ran, the gradients exist and match float64
    within the fp8 bound, and SGD steps lower the loss."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    torch._dynamo.reset()
    counter = BackwardCounter(monkeypatch)
    model = nn.Sequential(nn.Linear(64, 96, device=device, dtype=torch.bfloat16))
    w0, b0 = model[0].weight.detach().double().clone(), model[0].bias.detach().double().clone()
    parallelize_module(model, mesh, {"0": ColwiseParallel() if style == "colwise" else RowwiseParallel()})
    fp8tensor.convert_to_fp8(model)
    comp = torch.compile(model, backend=backend)
    x = torch.randn(40, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(40, 96, device=device, dtype=torch.bfloat16)
    y = comp(x)
    y.backward(gy)
    assert counter.calls > 0, "the compiled tensor-parallel fp8 Linear did not run the autograd Function"
    lin = model[0]
    xd, gyd = x.detach().double(), gy.double()
    assert rel(full(y), xd @ w0.t() + b0) < FP8_BOUND
    assert x.grad is not None and rel(full(x.grad), gyd @ w0) < FP8_BOUND
    assert rel(full(lin.weight.grad), gyd.t() @ xd) < FP8_BOUND and rel(full(lin.bias.grad), gyd.sum(0)) < 1e-2
    target = torch.randn(40, 96, device=device, dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = (full(comp(x.detach())).float() - target.float()).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses


class FunctionalLinear(nn.Module):
    """A user module that calls :func:`fp8tensor.fp8_linear` on its own plain ``nn.Parameter`` weight and bias (no
    conversion: nothing of fp8tensor has run eagerly before the first compiled call)."""

    def __init__(self, K, N, device, dtype=torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N, K, device=device, dtype=dtype) / K**0.5)
        self.bias = nn.Parameter(torch.randn(N, device=device, dtype=dtype))

    def forward(self, x):
        return fp8tensor.fp8_linear(x, self.weight, self.bias)


def functional_compiled_first_errors(device: str, backend: str, seed: int) -> dict:
    """Compile :class:`FunctionalLinear` (2-D and 3-D inputs) *before* any eager fp8tensor call in this process, run
    forward and backward, then the same module eagerly. Returns, per ``ndim`` and tensor, ``(compiled vs eager,
    compiled vs float64)`` relative errors. Run in a fresh process (:func:`check_functional_compiled_first`): a
    cache that fp8tensor fills on first use would be filled inside the traced ``autograd.Function`` there (dynamo then
    rejected the saved fp8 operand of grad_weight)."""
    torch.manual_seed(seed)
    K, N = 64, 48
    out = {}
    for ndim in (2, 3):
        torch._dynamo.reset()
        eager = FunctionalLinear(K, N, device)
        comp_mod = copy.deepcopy(eager)
        shape = (37, K) if ndim == 2 else (3, 13, K)
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        gy = torch.randn(*shape[:-1], N, device=device, dtype=torch.bfloat16)
        yc, gxc, gwc, gbc = run(torch.compile(comp_mod, backend=backend, fullgraph=True), x, gy)
        ye, gxe, gwe, gbe = run(eager, x, gy)
        wd, bd = eager.weight.detach().double(), eager.bias.detach().double()
        xd, gyd = x.double().reshape(-1, K), gy.double().reshape(-1, N)
        refs = {"output": xd @ wd.t() + bd, "grad_input": gyd @ wd, "grad_weight": gyd.t() @ xd,
                "grad_bias": gyd.sum(0)}
        for name, c, e in (("output", yc, ye), ("grad_input", gxc, gxe), ("grad_weight", gwc, gwe),
                           ("grad_bias", gbc, gbe)):
            if c is None or e is None or c.shape != e.shape or c.dtype != e.dtype:
                out[f"{ndim}d {name}"] = None
                continue
            out[f"{ndim}d {name}"] = (rel(c, e), rel(c.reshape(refs[name].shape), refs[name]))
    return out


def _in_fresh_process(call: str, seed: int):
    """The JSON result of ``_compile_path.<call>`` run in a fresh Python process (nothing of fp8tensor ran before)."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    code = f"import json, _compile_path as c; print('RESULT', json.dumps(c.{call}))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"seed {seed}: the fresh process failed:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def check_functional_compiled_first(device: str, backend: str, seed: int, bit_exact: bool) -> None:
    """:func:`functional_compiled_first_errors` in a fresh Python process; every result exists, agrees with eager (to
    the bit if ``bit_exact``, else within :data:`COMPILED_VS_EAGER_BOUND`) and with float64 within the fp8 bound."""
    errors = _in_fresh_process(f"functional_compiled_first_errors({device!r}, {backend!r}, {seed})", seed)
    for name, e in errors.items():
        assert e is not None, f"seed {seed}: {name} missing, or its shape / dtype differs from eager"
        vs_eager, vs_ref = e
        if bit_exact:
            assert vs_eager == 0.0, f"seed {seed}: {name}: compiled differs from eager by {vs_eager:.3g}"
        else:
            assert vs_eager < COMPILED_VS_EAGER_BOUND, f"seed {seed}: {name}: compiled vs eager {vs_eager:.3g}"
        bound = 1e-2 if name.endswith("grad_bias") else FP8_BOUND
        assert vs_ref < bound, f"seed {seed}: {name}: {vs_ref:.3g} from float64 (bound {bound})"


def check_compiled_under_stale_config_block(monkeypatch, *, device: str, backend: str, bit_exact: bool,
                                            read_settings_in_forward: bool) -> None:
    """Inside a ``fp8tensor.config`` block that ``set_config`` made stale (the block's merged settings are re-merged
    at the next :func:`fp8tensor.get_config`), a compiled :class:`FunctionalLinear` trains as eager does. The re-merge
    was cached into the thread's state even while dynamo traced the fp8 Linear's ``autograd.Function`` forward (which
    reads the settings on CUDA, in its quantization of ``x``): a side effect there, so dynamo rejected the saved fp8
    operand of grad_weight. ``read_settings_in_forward``: make the forward read the settings where it does not (CPU)."""
    from fp8tensor.core.settings import get_config
    from fp8tensor.training import linear as L

    if read_settings_in_forward:
        k_scaled = L._k_scaled

        def reading(w):  # (called in the Function's forward; on CUDA, quantize_token_layouts reads the settings)
            get_config()
            return k_scaled(w)

        monkeypatch.setattr(L, "_k_scaled", reading)
    torch._dynamo.reset()
    K, N = 64, 48
    eager = FunctionalLinear(K, N, device)
    comp_mod = copy.deepcopy(eager)
    x = torch.randn(3, 13, K, device=device, dtype=torch.bfloat16)
    gy = torch.randn(3, 13, N, device=device, dtype=torch.bfloat16)
    with fp8tensor.config(unknown_ops="warn"):
        fp8tensor.set_config()  # new process-wide settings (same values): the block's merge is stale now
        yc, gxc, gwc, gbc = run(torch.compile(comp_mod, backend=backend, fullgraph=True), x, gy)
        ye, gxe, gwe, gbe = run(eager, x, gy)
    wd, bd = eager.weight.detach().double(), eager.bias.detach().double()
    xd, gyd = x.double().reshape(-1, K), gy.double().reshape(-1, N)
    for name, c, e, ref, bound in (("output", yc, ye, xd @ wd.t() + bd, FP8_BOUND),
                                   ("grad_input", gxc, gxe, gyd @ wd, FP8_BOUND),
                                   ("grad_weight", gwc, gwe, gyd.t() @ xd, FP8_BOUND),
                                   ("grad_bias", gbc, gbe, gyd.sum(0), 1e-2)):
        assert c is not None and c.shape == e.shape and c.dtype == e.dtype, name
        if bit_exact:
            assert torch.equal(c, e), f"{name}: compiled differs from eager by {rel(c, e):.3g}"
        else:
            assert rel(c, e) < COMPILED_VS_EAGER_BOUND, f"{name}: compiled vs eager {rel(c, e):.3g}"
        assert rel(c.reshape(ref.shape), ref) < bound, f"{name}: {rel(c.reshape(ref.shape), ref):.3g} from float64"


class _OwnLinear(nn.Linear):
    """A user subclass of ``nn.Linear``: its converted class is made at conversion, first used compiled."""


def converted_compiled_first_runs(device: str, backend: str, seed: int) -> dict:
    """Run in a fresh process (nothing of fp8tensor called eagerly before): converted models compiled *first*, with
    ``torch._dynamo.config.error_on_recompile`` on, three calls each; then the same models compiled again after
    ``torch._dynamo.reset()``, then run eagerly. Per case, ``(compiled first vs compiled again, compiled first vs
    eager, compiled first vs float64)`` as relative errors of the outputs and gradients, or the error raised.

    A memo that fp8tensor filled on first use inside the compiled forward made dynamo guard the graph on the memo
    and replay its filling: every model compiled before its first eager call compiled twice, the first graph unlike
    the later ones (a training run's first losses differed from a rerun's in the same process)."""
    torch.manual_seed(seed)
    torch._dynamo.config.error_on_recompile = True
    dt = torch.bfloat16
    K, H, N = 64, 96, 48

    def build(kind):
        torch.manual_seed(seed)
        if kind == "own_class":
            m = nn.Sequential(_OwnLinear(K, H), nn.ReLU(), _OwnLinear(H, N)).to(device, dt)
        else:
            m = nn.Sequential(nn.Linear(K, H), nn.ReLU(), nn.Linear(H, N)).to(device, dt)
        hp = [m[0].weight.detach().double().clone(), m[0].bias.detach().double().clone(),
              m[2].weight.detach().double().clone(), m[2].bias.detach().double().clone()]
        if kind == "quantize_weights":
            fp8tensor.quantize_weights(m)
        else:
            fp8tensor.convert_to_fp8(m, recipe="rowwise_gw_hp" if kind == "gw_hp" else "rowwise")
        return m, hp

    def call(m, x, grads):
        if not grads:
            with torch.no_grad():
                return [m(x)]
        x = x.detach().clone().requires_grad_(True)
        y = m(x)
        y.float().square().sum().backward()
        outs = [y.detach(), x.grad]
        outs += [p.grad for p in m.parameters() if p.grad is not None]
        for p in m.parameters():
            p.grad = None
        return outs

    results = {}
    for kind in ("rowwise", "gw_hp", "own_class", "quantize_weights"):
        grads = kind != "quantize_weights"
        x = torch.randn(3, 13, K, device=device, dtype=dt)
        try:
            torch._dynamo.reset()
            first, hp = build(kind)
            cfirst = torch.compile(first, backend=backend)
            runs = [call(cfirst, x, grads) for _ in range(3)]
            torch._dynamo.reset()
            again, _ = build(kind)
            ragain = call(torch.compile(again, backend=backend), x, grads)
            eager, _ = build(kind)
            reager = call(eager, x, grads)
        except Exception as e:  # (a recompile raises here)
            results[kind] = f"{type(e).__name__}: {str(e)[:600]}"
            continue
        w0, b0, w2, b2 = hp
        ref = torch.relu(x.double() @ w0.t() + b0) @ w2.t() + b2
        out = runs[0]
        results[kind] = dict(
            same_three=all(len(r) == len(out) and all(torch.equal(a, b) for a, b in zip(r, out)) for r in runs),
            vs_again=max(rel(a, b) for a, b in zip(out, ragain)) if len(out) == len(ragain) else None,
            vs_eager=max(rel(a, b) for a, b in zip(out, reager)) if len(out) == len(reager) else None,
            vs_ref=rel(out[0], ref), n=len(out))
    return results


def check_converted_compiled_first(device: str, backend: str, seed: int, bit_exact: bool) -> None:
    """:func:`converted_compiled_first_runs` in a fresh Python process: no recompile; the compiled-first model gives
    the same bits as the same model compiled again (any backend: the same graph), agrees with eager (to the bit if
    ``bit_exact``) and with float64 within the bound of two fp8 GEMMs in series."""
    runs = _in_fresh_process(f"converted_compiled_first_runs({device!r}, {backend!r}, {seed})", seed)
    for kind, r in runs.items():
        assert isinstance(r, dict), f"seed {seed}: {kind}: {r}"
        assert r["n"] == (1 if kind == "quantize_weights" else 6), (seed, kind, r)
        assert r["same_three"], f"seed {seed}: {kind}: the compiled-first model's calls differ"
        assert r["vs_again"] == 0.0, f"seed {seed}: {kind}: compiled first vs compiled again: {r['vs_again']}"
        if bit_exact:
            assert r["vs_eager"] == 0.0, f"seed {seed}: {kind}: compiled vs eager: {r['vs_eager']}"
        else:  # two fp8 GEMMs in series: the second quantizes an input whose ulps differ (inductor's fused ReLU)
            assert r["vs_eager"] < 2 * COMPILED_VS_EAGER_BOUND, (
                f"seed {seed}: {kind}: compiled vs eager {r['vs_eager']}")
        assert r["vs_ref"] < 2 * FP8_BOUND, f"seed {seed}: {kind}: {r['vs_ref']:.3g} from float64"


def config_block_after_compiled_first(device: str, backend: str, seed: int) -> dict:
    """Run in a fresh process (no ``fp8tensor.config`` block entered before in this thread): a ``quantize_weights``
    model (its no-grad forward reads ``weight_only_decode`` while dynamo traces it) and a function reading the
    settings, each compiled and called *first* outside any block, then called inside ``fp8tensor.config(...)``
    blocks. Returns the graphs compiled per phase, the function's results against eager, and the model's outputs
    against float64.

    The thread's settings state was a ``threading.local`` with class-level defaults, set on the instance only at the
    thread's first block: a graph traced before that was guarded on the fields' absence from the thread-local
    ``__dict__``, a guard later blocks did not fail, so the compiled model ignored every block around its calls."""
    from torch._dynamo.backends.registry import lookup_backend

    from fp8tensor.core.settings import get_config

    torch.manual_seed(seed)
    compiled = [0]
    inner = lookup_backend(backend)

    def counting(gm, example_inputs):
        compiled[0] += 1
        return inner(gm, example_inputs)

    def probe(x):
        return x + (1.0 if get_config().weight_only_decode else 2.0)

    out = {}
    cprobe = torch.compile(probe, backend=counting, fullgraph=True)
    z = torch.zeros(2, device=device)
    out["probe_outside"] = (cprobe(z).tolist(), probe(z).tolist())
    with fp8tensor.config(weight_only_decode=False):
        out["probe_block"] = (cprobe(z).tolist(), probe(z).tolist())
    out["probe_after"] = (cprobe(z).tolist(), probe(z).tolist())
    out["probe_graphs"] = compiled[0]

    compiled[0] = 0
    K, N = 64, 48
    lin = nn.Linear(K, N, device=device, dtype=torch.bfloat16)
    w, b = lin.weight.detach().double().clone(), lin.bias.detach().double().clone()
    fp8tensor.quantize_weights(lin)
    cm = torch.compile(lin, backend=counting)
    x = torch.randn(3, 13, K, device=device, dtype=torch.bfloat16)
    ref = x.double() @ w.t() + b
    graphs, errors = [], []
    for phase in ("outside", "block", "after", "block again"):
        with (fp8tensor.config(weight_only_decode=False) if phase.startswith("block")
              else contextlib.nullcontext()), torch.no_grad():
            y = cm(x)
        graphs.append(compiled[0])
        errors.append(rel(y, ref))
    out["model_graphs"], out["model_vs_ref"] = graphs, errors
    return out


def check_config_block_after_compiled_first(device: str, backend: str, seed: int) -> None:
    """:func:`config_block_after_compiled_first` in a fresh process: a block entered around the call of a model
    compiled before the thread's first block reaches the compiled code (the block's setting, a second graph traced
    under it, reused by a later block; the first graph again outside), outputs within the fp8 bound of float64."""
    r = _in_fresh_process(f"config_block_after_compiled_first({device!r}, {backend!r}, {seed})", seed)
    assert r["probe_outside"] == [[1.0, 1.0]] * 2, (seed, r)
    assert r["probe_block"] == [[2.0, 2.0]] * 2, f"seed {seed}: the compiled code ignored the config block: {r}"
    assert r["probe_after"] == [[1.0, 1.0]] * 2, (seed, r)
    assert r["probe_graphs"] == 2, (seed, r)
    assert r["model_graphs"] == [1, 2, 2, 2], (
        f"seed {seed}: graphs compiled after the call outside, inside a block, after it, inside again: "
        f"{r['model_graphs']} (the block never reached the model compiled first: [1, 1, 1, 1])")
    assert all(e < FP8_BOUND for e in r["model_vs_ref"]), f"seed {seed}: {r['model_vs_ref']} from float64"



def whole_model_compile_under_fsdp(device: str, backend: str, seed: int) -> dict:
    """Run in a fresh process (a 1-rank gloo group, dynamo's counters from zero): models of ``nn.Sequential`` blocks,
    ``fully_shard`` per block and on the root, compiled whole (``torch.compile(model)``), three forward + backward
    steps each. ``"shapes"``: five blocks and a head, Linears of eleven weight shapes; ``"same"``: six blocks of
    Linears of one shape. Each model unconverted (bf16 ``nn.Linear``; ``"+hook"``: with a no-op forward pre-hook on
    every Linear; ``"own forward"``: :class:`_LinearOwnForward`) and converted (``convert_to_fp8``). Returns per run the frames dynamo compiled, the graphs and the
    recompiles; for the converted ``"shapes"`` model, also its outputs and gradients against the same model eager and
    its first output against float64.

    FSDP2's hooks graph-break a whole-model compile, so each block's ``nn.Sequential.forward`` runs eagerly and calls
    its Linears from eager code. Dynamo then compiles each Linear's forward as a frame of its own, guarded on the
    weight's shape (one graph per shape, up to its recompile limit of 8), unless the forward is torch's own
    ``nn.Linear.forward`` (on torch 2.13, only on a module without hooks). The fp8 Linear's forward must compile exactly
    as a Linear's forward defined outside torch does (compiled on every torch): no guard of its own (module instance,
    recipe, memo, settings) adds a recompile, and it adds no frame (its export pre-hook is never a frame of its
    own)."""
    import logging

    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dt = torch.bfloat16
    hidden = {"shapes": (96, 128, 160, 192, 224), "same": (64,) * 6}

    def build(kind, variant):
        torch.manual_seed(seed)
        L = _LinearOwnForward if variant == "own forward" else nn.Linear
        m = nn.Sequential(*[nn.Sequential(L(64, h), nn.ReLU(), L(h, 64)) for h in hidden[kind]],
                          L(64, 32)).to(device, dt)
        hp = [(lin.weight.detach().double().clone(), lin.bias.detach().double().clone())
              for lin in m.modules() if isinstance(lin, nn.Linear)]
        if variant == "fp8":
            fp8tensor.convert_to_fp8(m)
        elif variant == "nn.Linear+hook":
            for lin in m.modules():
                if isinstance(lin, nn.Linear):
                    lin.register_forward_pre_hook(lambda mod, args: None)
        for block in list(m)[:-1]:
            fully_shard(block)
        fully_shard(m)
        return m, hp

    recompiles = []

    class Seen(logging.Handler):
        def emit(self, record):
            if "Recompiling function" in record.getMessage():
                recompiles.append(record.getMessage().split("\n")[0])

    handler = Seen()
    logging.getLogger("torch._dynamo").addHandler(handler)
    torch._logging.set_logs(recompiles=True)
    torch.manual_seed(seed)
    x = torch.randn(4, 8, 64, device=device, dtype=dt)

    def steps(m):
        outs = []
        for _ in range(3):
            xi = x.detach().clone().requires_grad_(True)
            y = m(xi)
            y.float().square().mean().backward()
            outs.append([y.detach(), xi.grad] + [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                                                 for p in m.parameters()])
            for p in m.parameters():
                p.grad = None
        return outs

    out = {}
    compiled_fp8 = None
    for kind in ("shapes", "same"):
        for variant in ("nn.Linear", "nn.Linear+hook", "own forward", "fp8"):
            torch._dynamo.reset()
            counters.clear()
            recompiles.clear()
            model, hp = build(kind, variant)
            results = steps(torch.compile(model, backend=backend))
            out[f"{kind} {variant}"] = dict(frames=counters["frames"]["total"], frames_ok=counters["frames"]["ok"],
                                            graphs=counters["stats"]["unique_graphs"], recompiles=len(recompiles))
            if kind == "shapes" and variant == "fp8":
                compiled_fp8, hp_shapes = results, hp
    logging.getLogger("torch._dynamo").removeHandler(handler)
    torch._logging.set_logs()
    eager, _ = build("shapes", "fp8")
    reager = steps(eager)
    out["vs_eager"] = max(rel(a, b) for c, e in zip(compiled_fp8, reager) for a, b in zip(c, e))
    out["n"] = [len(c) for c in compiled_fp8] + [len(e) for e in reager]
    ref = x.double()
    for i, (w, b) in enumerate(hp_shapes):
        ref = ref @ w.t() + b
        if i % 2 == 0 and i < len(hp_shapes) - 1:
            ref = torch.relu(ref)
    out["vs_ref"] = rel(compiled_fp8[0][0], ref)
    dist.destroy_process_group()
    return out


class _LinearOwnForward(nn.Linear):
    """``nn.Linear`` with the same forward defined outside torch (dynamo compiles it as any user module's forward)."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


def check_whole_model_compile_under_fsdp(device: str, backend: str, seed: int) -> None:
    """:func:`whole_model_compile_under_fsdp` in a fresh process: the converted models compile the same frames,
    graphs and recompiles as the unconverted ones whose Linear forward is defined outside torch, one recompile (the
    head's shape) with one hidden shape; the converted model agrees with eager fp8 and with float64 within the fp8
    bound."""
    r = _in_fresh_process(f"whole_model_compile_under_fsdp({device!r}, {backend!r}, {seed})", seed)
    for kind in ("shapes", "same"):
        fp8, own = r[f"{kind} fp8"], r[f"{kind} own forward"]
        assert fp8 == own, f"seed {seed}: {kind}: compiles of the converted model {fp8}, of the Linears {own}"
    assert r["same fp8"]["recompiles"] == 1 and r["same fp8"]["frames"] == r["same fp8"]["frames_ok"], (seed, r)
    assert set(r["n"]) == {2 + 22}, (seed, r)
    assert r["vs_eager"] < COMPILED_VS_EAGER_BOUND, f"seed {seed}: compiled vs eager fp8: {r['vs_eager']:.3g}"
    assert r["vs_ref"] < FP8_BOUND, f"seed {seed}: {r['vs_ref']:.3g} from float64"
