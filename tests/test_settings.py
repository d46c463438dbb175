"""``fp8tensor.config`` / ``set_config`` / ``get_config``: scoping, validation, and the policy for ops without an fp8
implementation (warn once per op by default, raise under ``unknown_ops="raise"``)."""
from __future__ import annotations

import dataclasses
import threading
import warnings

import pytest
import torch

import fp8tensor
from fp8tensor import ScaledFp8Tensor
from fp8tensor import tensor as tensor_mod


@pytest.fixture(autouse=True)
def _no_scope_left_pending():
    """Each test leaves no ``config(...)`` scope made and not entered behind (it would fail the next test instead)."""
    from fp8tensor.core import settings

    yield
    left = [r() for r in getattr(settings._local, "pending", None) or []]
    if left:
        settings._local.pending.clear()
        pytest.fail(f"config scopes left pending by this test: {left}")


def test_config_scopes_and_restores():
    base = fp8tensor.get_config()
    with fp8tensor.config(gemm_backend="emulated") as c:
        assert c.gemm_backend == "emulated" and fp8tensor.get_gemm_backend() == "emulated"
        with fp8tensor.gemm_backend("tensorwise"):
            assert fp8tensor.get_config().gemm_backend == "tensorwise"
            assert fp8tensor.get_config().unknown_ops == base.unknown_ops
        assert fp8tensor.get_config().gemm_backend == "emulated"
    assert fp8tensor.get_config() == base


def test_config_is_per_thread():
    seen = []
    with fp8tensor.config(unknown_ops="raise"):
        t = threading.Thread(target=lambda: seen.append(fp8tensor.get_config().unknown_ops))
        t.start()
        t.join()
    assert seen == [fp8tensor.get_config().unknown_ops]


def test_set_config_process_wide():
    old = fp8tensor.get_config()
    try:
        fp8tensor.set_config(gemm_backend="emulated")
        assert fp8tensor.get_gemm_backend() == "emulated"
        fp8tensor.set_gemm_backend("auto")
        assert fp8tensor.get_config().gemm_backend == "auto"
    finally:
        fp8tensor.set_config(**dataclasses.asdict(old))


def test_defaults():
    assert dataclasses.asdict(fp8tensor.Config()) == dict(
        gemm_backend="auto", unknown_ops="warn", weight_only_decode=True, compiled_quantization="kernels", grouped_gemm_kernel=True, size_rule=False, size_rule_min=640,
        size_rule_fp8_grad_weight_min=1024, fp8_all_gather_min_numel=2**27, state_dict_fp8="subclass")


def test_every_knob_scopes():
    base = fp8tensor.get_config()
    changes = dict(weight_only_decode=False, compiled_quantization="inductor",
                   grouped_gemm_kernel=False, size_rule=True, size_rule_min=1000.5, fp8_all_gather_min_numel=4096,
                   state_dict_fp8="plain")
    with fp8tensor.config(**changes) as c:
        assert {k: getattr(fp8tensor.get_config(), k) for k in changes} == changes and c == fp8tensor.get_config()
        with fp8tensor.config(compiled_quantization="kernels"):
            assert fp8tensor.get_config().compiled_quantization == "kernels"
            assert fp8tensor.get_config().size_rule is True
    assert fp8tensor.get_config() == base


@pytest.mark.parametrize("changes, err, match", [
    (dict(gemm_backend="fast"), ValueError, "unknown gemm_backend 'fast'"),
    (dict(unknown_ops="ignore"), ValueError, "unknown unknown_ops 'ignore'"),
    (dict(backend="auto"), TypeError, r"unknown setting\(s\) \['backend'\]"),
    (dict(recipe="rowwise"), TypeError, r"unknown setting\(s\) \['recipe'\]"),
    (dict(gemm_backend="fastest"), ValueError, "unknown gemm_backend 'fastest'"),
    (dict(state_dict_fp8="hf"), ValueError, "unknown state_dict_fp8 'hf'"),
    (dict(compiled_quantization="triton"), ValueError, "unknown compiled_quantization 'triton'"),
    (dict(weight_only_decode=0), ValueError, "weight_only_decode must be True or False, got 0"),
    (dict(grouped_gemm_kernel=None), ValueError, "grouped_gemm_kernel must be True or False"),
    (dict(size_rule=1), ValueError, "size_rule must be True or False"),
    (dict(size_rule_min=0), ValueError, "size_rule_min must be a positive finite number, got 0"),
    (dict(size_rule_min=-5.0), ValueError, "size_rule_min must be a positive"),
    (dict(size_rule_min=float("inf")), ValueError, "size_rule_min must be a positive"),
    (dict(size_rule_min=float("nan")), ValueError, "size_rule_min must be a positive"),
    (dict(size_rule_min="640"), ValueError, "size_rule_min must be a positive"),
    (dict(size_rule_min=True), ValueError, "size_rule_min must be a positive"),
])
def test_bad_settings_raise_and_change_nothing(changes, err, match):
    before = fp8tensor.get_config()
    with pytest.raises(err, match=match):
        fp8tensor.set_config(**changes)
    with pytest.raises(err, match=match):
        fp8tensor.config(**changes)  # raised when called, before any `with`
    assert fp8tensor.get_config() == before


def test_config_without_with_raises_at_the_next_operation():
    """``fp8tensor.config(...)`` without ``with`` would change nothing: the next fp8tensor operation of the thread
    raises, once, naming the fix; nothing changed."""
    before = fp8tensor.get_config()
    fp8tensor.config(gemm_backend="emulated")  # the mistake (the result is dropped)
    with pytest.raises(RuntimeError, match="without `with`"):
        fp8tensor.fp8_linear(torch.randn(4, 16), torch.randn(8, 16))
    assert fp8tensor.get_config() == before  # reported once; nothing changed
    kept = fp8tensor.config(unknown_ops="allow")  # kept and not entered: set_config raises too
    with pytest.raises(RuntimeError, match="set_config"):
        fp8tensor.set_config(unknown_ops="raise")
    assert fp8tensor.get_config() == before
    with kept as c:  # a scope entered later works
        assert c.unknown_ops == "allow" == fp8tensor.get_config().unknown_ops
    assert fp8tensor.get_config() == before


def test_config_scope_in_another_thread_is_its_own():
    import threading

    seen = {}
    base = fp8tensor.get_config().unknown_ops
    fp8tensor.config(gemm_backend="emulated")  # a mistake in this thread only

    def other():
        with fp8tensor.config(unknown_ops="raise"):
            seen["inside"] = fp8tensor.get_config().unknown_ops
        seen["after"] = fp8tensor.get_config().unknown_ops

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == {"inside": "raise", "after": base}
    with pytest.raises(RuntimeError, match="without `with`"):
        fp8tensor.get_config()


def _fp8(shape=(8, 16)):
    """A ScaledFp8Tensor with values inside erfinv's domain (-1, 1): erfinv has no fp8 implementation."""
    return ScaledFp8Tensor.from_hp(torch.rand(*shape) * 1.8 - 0.9)


def test_unknown_op_warns_once_and_computes_in_high_precision():
    x = _fp8()
    tensor_mod._WARNED_OPS.discard("aten.erfinv.default")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out1 = torch.erfinv(x)
        out2 = torch.erfinv(x)
    msgs = [str(m.message) for m in w if "has no fp8 implementation" in str(m.message)]
    assert len(msgs) == 1 and "aten.erfinv.default" in msgs[0] and "fp8tensor.dequantize" in msgs[0], msgs
    assert type(out1) is torch.Tensor and out1.dtype == torch.float32
    ref = torch.erfinv(x.to_hp(torch.float64))  # the same op on the exact dequantized values
    assert ((out1.double() - ref).norm() / ref.norm()).item() < 1e-6
    assert torch.equal(out1, out2)


def test_unknown_op_raises_under_strict_setting():
    x = _fp8()
    with fp8tensor.config(unknown_ops="raise"):
        with pytest.raises(NotImplementedError, match=r"ScaledFp8Tensor: aten\.erfinv\.default has no fp8 implementation"):
            torch.erfinv(x)


def test_unknown_op_allowed_silently():
    x = _fp8()
    tensor_mod._WARNED_OPS.clear()
    with fp8tensor.config(unknown_ops="allow"), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torch.erfinv(x)
    assert torch.equal(out, torch.erfinv(x.to_hp()))


def test_recipe_float8_dtype_is_an_fp8_format():
    """A recipe's fp8 format is the weight side of every GEMM (the other operand is e4m3): only fp8 formats."""
    import torch

    from fp8tensor import Recipe
    from fp8tensor.recipes import Gemm, Operand, weight_format

    assert weight_format(Recipe("r"), torch.float8_e5m2).float8_dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match="float8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        Operand("rowwise", torch.bfloat16)
    with pytest.raises(ValueError, match="activation side"):
        Gemm(a=Operand("rowwise", torch.float8_e5m2))
    with pytest.raises(ValueError, match="both operands are fp8 or both high precision"):
        Gemm(b=Operand("hp"))
    with pytest.raises(ValueError, match="tensor-wise scaling is not offered"):
        Operand("tensorwise")
    with pytest.raises(ValueError, match="one fp8 format"):
        Recipe("r", grad_input=Gemm(b=Operand("rowwise", torch.float8_e5m2)))


def test_set_config_inside_a_block_changes_the_fields_the_block_does_not_name():
    old = fp8tensor.get_config()
    try:
        with fp8tensor.config(unknown_ops="raise"):
            fp8tensor.set_config(gemm_backend="emulated", unknown_ops="allow")
            c = fp8tensor.get_config()
            assert c.gemm_backend == "emulated" and c.unknown_ops == "raise"  # the block's field wins in the block
        c = fp8tensor.get_config()
        assert c.gemm_backend == "emulated" and c.unknown_ops == "allow"
    finally:
        fp8tensor.set_config(**{f: getattr(old, f) for f in ("gemm_backend", "unknown_ops")})


def test_backward_runs_under_the_settings_of_its_forward(monkeypatch):
    """A config block around the forward reaches its backward, even when the backward runs after the block ended (or
    in autograd's device threads, which a thread-local block does not reach); the settings outside are restored."""
    from fp8tensor import linear as linear_mod

    seen = []
    real = linear_mod._backward

    def spy(ctx, grad_out):
        seen.append(fp8tensor.get_config().gemm_backend)
        return real(ctx, grad_out)

    monkeypatch.setattr(linear_mod, "_backward", spy)
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    with fp8tensor.config(gemm_backend="emulated"):
        y = fp8tensor.fp8_linear(x, w)
    outside = fp8tensor.get_config().gemm_backend
    y.sum().backward()
    assert seen == ["emulated"] and fp8tensor.get_config().gemm_backend == outside != "emulated"
    # and the reverse: a forward outside any block, its backward inside one, runs under the forward's settings
    seen.clear()
    y = fp8tensor.fp8_linear(x, w)
    with fp8tensor.config(gemm_backend="emulated"):
        y.sum().backward()
    assert seen == [outside]


@pytest.mark.parametrize("mode", ["kernels", "inductor"])
def test_compiled_weight_columns_are_plain_ops(monkeypatch, mode):
    # While a graph is traced, a master weight's column quantization (grad_input's operand) is plain ops that
    # inductor generates, whatever compiled_quantization says (an opaque op there costs a Python call per Linear per
    # step). Made observable on CPU: the kernels are declared available and their launch raises, so only a kernel
    # path could fail; the plain path must give the float64-checked values.
    from fp8tensor.numerics import kernels, quantize as q

    monkeypatch.setattr(q.compat, "is_compiling", lambda: True)
    monkeypatch.setattr(kernels, "kernel_available", lambda x: True)
    monkeypatch.setattr(kernels, "eager_launch_ok", lambda x: False)

    def launch(*a, **k):
        raise RuntimeError("kernel launched")

    monkeypatch.setattr(kernels, "launch_dim0_t", launch)
    w = torch.randn(48, 32, dtype=torch.float64) * torch.logspace(-2, 2, 32, dtype=torch.float64)
    g = torch.randn(5, 48)
    with fp8tensor.config(compiled_quantization=mode):
        assert q._inductor_quantizes(w) is (mode == "inductor")
        qt, st = q.quantize_dim0_t_after(w.float(), g)
    assert qt.shape == (32, 48) and st.shape == (32, 1)
    deq = qt.double() * st.double()  # (K, N) ≈ w.T, one e4m3 rounding per element: relative error <= 2^-4
    assert ((deq - w.t()).norm() / w.norm()).item() < 2.0 ** -4


# ------------------------------------------------------------------------------------- config(...) without `with`
def test_a_dropped_config_is_caught_by_the_next_config_call():
    """The usual slip: a bare ``fp8tensor.config(...)`` line followed by a correct block. The bare line's scope is
    gone before the block starts; the block's ``config(...)`` call raises, naming the fix, and nothing changed."""
    before = fp8tensor.get_config()
    fp8tensor.config(unknown_ops="raise")  # the mistake
    with pytest.raises(RuntimeError, match="without `with`"):
        with fp8tensor.config(gemm_backend="emulated"):
            pytest.fail("the block must not run")  # pragma: no cover
    assert fp8tensor.get_config() == before
    with fp8tensor.config(gemm_backend="emulated") as c:  # reported once: the next block works
        assert c.gemm_backend == "emulated" == fp8tensor.get_config().gemm_backend
    assert fp8tensor.get_config() == before


def test_scopes_made_first_and_entered_together_work():
    before = fp8tensor.get_config()
    outer, inner = fp8tensor.config(gemm_backend="emulated"), fp8tensor.config(unknown_ops="allow")
    with outer, inner:
        c = fp8tensor.get_config()
        assert (c.gemm_backend, c.unknown_ops) == ("emulated", "allow")
    assert fp8tensor.get_config() == before
    # one of two entered, the other still pending: the next operation raises and names the pending one
    outer, inner = fp8tensor.config(gemm_backend="emulated"), fp8tensor.config(unknown_ops="allow")
    with outer:
        with pytest.raises(RuntimeError, match=r"fp8tensor\.config\(unknown_ops='allow'\), not entered yet"):
            fp8tensor.get_config()
        assert fp8tensor.get_config().gemm_backend == "emulated"  # the entered block still holds
    assert fp8tensor.get_config() == before


def test_a_scope_is_entered_once_at_a_time_and_again_after():
    before = fp8tensor.get_config()
    scope = fp8tensor.config(size_rule=True)
    with scope:
        with pytest.raises(RuntimeError, match="already entered"):
            with scope:
                pass  # pragma: no cover
        assert fp8tensor.get_config().size_rule is True
    assert fp8tensor.get_config() == before
    with scope:  # entered again after its block ended
        assert fp8tensor.get_config().size_rule is True
    assert fp8tensor.get_config() == before


def test_nested_blocks_restore_each_level_also_on_errors():
    before = fp8tensor.get_config()
    with fp8tensor.config(gemm_backend="emulated", unknown_ops="allow"):
        with pytest.raises(KeyError):
            with fp8tensor.config(unknown_ops="raise", size_rule=True):
                c = fp8tensor.get_config()
                assert (c.gemm_backend, c.unknown_ops, c.size_rule) == ("emulated", "raise", True)
                raise KeyError("inside")
        c = fp8tensor.get_config()
        assert (c.gemm_backend, c.unknown_ops, c.size_rule) == ("emulated", "allow", before.size_rule)
    assert fp8tensor.get_config() == before


def test_threads_in_their_own_blocks_do_not_see_each_other():
    """Two threads, each inside its own block, read their own settings while the other's block is open (a barrier
    holds both blocks open at once); the main thread's settings are untouched, and a bare ``config(...)`` in one
    thread does not disturb the other."""
    before = fp8tensor.get_config()
    barrier = threading.Barrier(2, timeout=30)
    seen, errors = {}, []

    def worker(name, backend, bare):
        try:
            with fp8tensor.config(gemm_backend=backend):
                barrier.wait()
                seen[name] = fp8tensor.get_config().gemm_backend
                barrier.wait()
            if bare:
                fp8tensor.config(unknown_ops="raise")  # this thread's mistake
                barrier.wait()
                try:
                    fp8tensor.get_config()
                except RuntimeError as e:
                    seen[name + " bare"] = "raised" if "without `with`" in str(e) else str(e)
            else:
                barrier.wait()
                seen[name + " after"] = fp8tensor.get_config().gemm_backend
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=("a", "emulated", True)),
               threading.Thread(target=worker, args=("b", "tensorwise", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen == {"a": "emulated", "b": "tensorwise", "a bare": "raised", "b after": before.gemm_backend}, seen
    assert fp8tensor.get_config() == before


def _bad_values(field: dataclasses.Field) -> list:
    """Values every field of its kind must refuse with ValueError (by the field's annotation)."""
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    if kind == "bool":
        return [0, 1, "True", None, 1.0]
    if kind == "str":
        return ["no-such-choice", "", None, 3, field.default.upper() + "X"]
    if kind in ("float", "int"):
        return [0, -1, -0.5, float("inf"), float("nan"), "640", None, True, [640]]
    raise AssertionError(f"Config.{field.name}: annotation {kind!r} has no bad values here; add them")


@pytest.mark.parametrize("field", dataclasses.fields(fp8tensor.Config), ids=lambda f: f.name)
def test_every_field_refuses_bad_values_everywhere(field):
    """Every Config field, through each of the three doors (``Config(...)``, ``set_config``, ``config``), refuses
    values of the wrong type or outside its choices with a ValueError naming the field; nothing changes."""
    before = fp8tensor.get_config()
    for bad in _bad_values(field):
        for door in (fp8tensor.Config, fp8tensor.set_config, fp8tensor.config):
            with pytest.raises(ValueError, match=field.name):
                door(**{field.name: bad})
            assert fp8tensor.get_config() == before, (door, bad)


@pytest.mark.parametrize("door", [fp8tensor.Config, fp8tensor.set_config, fp8tensor.config],
                         ids=["Config", "set_config", "config"])
def test_unknown_keys_raise_type_error_and_change_nothing(door):
    before = fp8tensor.get_config()
    with pytest.raises(TypeError, match="recipe"):
        door(recipe="rowwise", gemm_backend="emulated")  # one good key does not let the unknown one through
    assert fp8tensor.get_config() == before


def test_docs_enter_every_config_block():
    """README, docs, examples and benchmarks (the code users copy) write ``fp8tensor.config(...)`` (and its
    ``fp8tensor.gemm_backend(...)`` form) only as ``with ...:`` blocks: a bare call changes nothing (and raises)."""
    import pathlib
    import re

    root = pathlib.Path(fp8tensor.__file__).parent.parent
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "examples").glob("*.py")),
             *sorted((root / "benchmarks").glob("*.py"))]
    call = re.compile(r"(fp8tensor\.(?:config|gemm_backend)\()")
    bare = []
    for f in files:
        if not f.exists():
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for m in call.finditer(line):
                if not re.search(r"\bwith\s+(?:\S+\s*,\s*)*$", line[:m.start()]):
                    bare.append(f"{f.relative_to(root)}:{n}: {line.strip()}")
    assert not bare, "fp8tensor.config(...) written without `with`:\n" + "\n".join(bare)


def test_blocks_of_interleaved_generators_end_in_any_order():
    """Two generators each suspended inside their own block: whichever ends first, the settings in force are those of
    the blocks still open, and none outlives its block (before: ending them out of order left one block's settings
    in force after both ended)."""
    base = fp8tensor.get_config()

    def gen(**changes):
        with fp8tensor.config(**changes):
            yield fp8tensor.get_config()
            yield fp8tensor.get_config()

    a, b = gen(unknown_ops="raise"), gen(gemm_backend="emulated")
    assert next(a).unknown_ops == "raise"
    inside_b = next(b)
    assert inside_b.unknown_ops == "raise" and inside_b.gemm_backend == "emulated"
    for _ in a:  # a's block ends first, b's is still open
        pass
    now = fp8tensor.get_config()
    assert now.gemm_backend == "emulated" and now.unknown_ops == base.unknown_ops
    assert next(b).unknown_ops == base.unknown_ops
    for _ in b:
        pass
    assert fp8tensor.get_config() == base


def test_the_backward_token_restores_the_open_blocks():
    """The token the fp8 Linear carries from forward to backward swaps in both the settings and the open blocks, and
    swapping back restores them: a block entered and left in between leaves nothing behind."""
    from fp8tensor.core.settings import scope_token, swap_scope

    base = fp8tensor.get_config()
    with fp8tensor.config(unknown_ops="raise"):
        token = scope_token()
    assert fp8tensor.get_config() == base and scope_token() is None
    with fp8tensor.config(gemm_backend="emulated"):
        prev = swap_scope(token)
        assert fp8tensor.get_config().unknown_ops == "raise"
        assert fp8tensor.get_config().gemm_backend == base.gemm_backend
        with fp8tensor.config(weight_only_decode=not base.weight_only_decode):
            pass
        swap_scope(prev)
        assert fp8tensor.get_config().gemm_backend == "emulated"
        assert fp8tensor.get_config().unknown_ops == base.unknown_ops
    assert fp8tensor.get_config() == base


def test_a_kept_scope_reenters_under_checkpointing_and_backward_leaves_no_settings():
    """Non-reentrant activation checkpointing re-runs the forward inside the fp8 Linear's backward, while the
    forward's blocks are swapped in: the same scope object enters again there. A backward run inside a block leaves
    the block's settings to the block, and none behind it."""
    from torch.utils.checkpoint import checkpoint

    from fp8tensor.training.linear import fp8_linear

    base = fp8tensor.get_config()
    cfg = fp8tensor.config(unknown_ops="raise")
    w = torch.randn(32, 32, requires_grad=True)

    def f(x):
        with cfg:
            return fp8_linear(x, w)

    x = torch.randn(16, 32, requires_grad=True)
    checkpoint(f, x, use_reentrant=False).sum().backward()
    assert x.grad is not None and w.grad is not None
    assert fp8tensor.get_config() == base
    with cfg:
        fp8_linear(x, w).sum().backward()
        assert fp8tensor.get_config().unknown_ops == "raise"
    assert fp8tensor.get_config() == base


def test_inductor_quantization_is_seen_where_aot_traces_below_the_subclass():
    # AOTAutograd runs the op table (and triton_op bodies) on fake / functional tensors while
    # torch.compiler.is_compiling() is False: compiled_quantization="inductor" must apply there too, and only to
    # traced tensors (an eager call keeps the kernels).
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8tensor.numerics import quantize as q

    with FakeTensorMode():
        fake = torch.empty(4, 8)
    real = torch.empty(4, 8)
    with fp8tensor.config(compiled_quantization="inductor"):
        assert q._inductor_quantizes(fake) and not q._inductor_quantizes(real)
    with fp8tensor.config(compiled_quantization="kernels"):
        assert not q._inductor_quantizes(fake) and not q._inductor_quantizes(real)


def _recording_backend(graphs: list):
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm, inputs):
        graphs.append(sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target)}))
        return gm.forward

    return aot_autograd(fw_compiler=fw)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("how", ["set_config", "block"])
@pytest.mark.parametrize("model", ["quantize_weights", "convert_to_fp8"])
def test_compiled_model_follows_a_later_change_of_a_traced_setting(grad, how, model):
    """The GEMM backend is read below dynamo (in the subclass's dispatch, while AOTAutograd traces): a compiled
    converted Linear recompiles when ``set_config`` or a ``config`` block changes it (and the other settings a graph
    bakes in), instead of running the graph traced under the old value; unchanged settings do not recompile."""
    torch._dynamo.reset()
    lin = getattr(fp8tensor, model)(torch.nn.Linear(64, 32))
    graphs: list = []
    f = torch.compile(lin, backend=_recording_backend(graphs))
    x = torch.randn(4, 64)
    try:
        with torch.set_grad_enabled(grad):
            f(x)
            f(x)
            assert len(graphs) == 1, graphs  # (no recompile while nothing changed)
            assert graphs[0] == ["aten._scaled_mm.default"], graphs
            if how == "block":
                with fp8tensor.config(gemm_backend="emulated"):
                    y = f(x)
            else:
                fp8tensor.set_config(gemm_backend="emulated")
                try:
                    y = f(x)
                finally:
                    fp8tensor.set_config(gemm_backend="auto")
            assert len(graphs) == 2 and "aten._scaled_mm.default" not in graphs[1], graphs
            with fp8tensor.config(gemm_backend="emulated"):
                want = lin(x)
            assert torch.equal(y, want)
            f(x)  # back to the first graph's settings: its graph again
            assert len(graphs) == 2, graphs
    finally:
        torch._dynamo.reset()


def test_a_block_made_in_one_thread_and_entered_in_another():
    """A ``config`` block made in one thread and entered in another (a worker pool): its settings hold in the worker,
    and the thread that made it is not told it was never entered; one never entered anywhere is still reported."""
    from concurrent.futures import ThreadPoolExecutor

    w = ScaledFp8Tensor.from_hp(torch.randn(16, 32))
    cfg = fp8tensor.config(gemm_backend="emulated")

    def work():
        with cfg:
            return fp8tensor.get_config().gemm_backend, (torch.randn(2, 32) @ w.t()).shape

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(work).result() == ("emulated", torch.Size([2, 16]))
    assert fp8tensor.get_config().gemm_backend == "auto"  # (no false "called without `with`" error here)
    torch.randn(2, 32) @ w.t()
    dropped = fp8tensor.config(gemm_backend="emulated")  # noqa: F841 (made, never entered)
    with pytest.raises(RuntimeError, match="without `with`"):
        fp8tensor.get_config()


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12),
                    reason="torch 2.11 keys subclass graph inputs without _stable_hash_for_caching (docs/design.md)")
def test_inductor_cache_does_not_reuse_a_graph_compiled_under_other_settings(tmp_path, monkeypatch):
    """The settings are read below dynamo, so the graph dynamo recompiles under a changed ``gemm_backend`` looks the
    same to inductor's AOTAutograd cache; the fp8 subclasses' cache key holds the settings, so the second compile
    misses the cache and runs the new backend (a hit returned the graph of the old one)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    lin = fp8tensor.quantize_weights(torch.nn.Linear(64, 32))
    f = torch.compile(lin)
    x = torch.randn(4, 64)
    try:
        with torch.no_grad():
            f(x)
            with fp8tensor.config(gemm_backend="emulated"):
                y = f(x)
                want = lin(x)
        assert counters["aot_autograd"].get("autograd_cache_hit", 0) == 0, dict(counters["aot_autograd"])
        assert torch.allclose(y, want, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()
