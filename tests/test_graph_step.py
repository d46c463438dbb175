"""``fp8tensor.graph_step`` where no CUDA graph can be captured (CPU): eager fallback with a warning, errors for bad
arguments. The captured path itself is tested on the GPU (``tests/gpu/test_gpu_graph_step.py``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor


def _model(seed: int, bias_free_tail: bool = False) -> nn.Module:
    """A converted MLP; ``bias_free_tail``: a last Linear without bias (a None entry among the module's parameters,
    which graph_step's checks must step over)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)]
    if bias_free_tail:
        layers.append(nn.Linear(32, 32, bias=False))
    model = nn.Sequential(*layers)
    fp8tensor.convert_to_fp8(model)
    return model


def test_cpu_step_runs_eagerly_with_a_warning_and_trains_as_the_plain_step():
    """On the CPU the step runs eagerly (one RuntimeWarning, on the first call): losses and weights equal those of
    calling fn directly in the same loop."""
    import warnings

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the step would be captured (tests/gpu/test_gpu_graph_step.py)")
    xs = [torch.randn(16, 64) for _ in range(5)]
    runs = []
    for graphed in (False, True):
        model = _model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def fwd_bwd(x):
            loss = model(x).square().mean()
            loss.backward()
            return loss.detach()

        step = fp8tensor.graph_step(fwd_bwd, model.parameters(), warmup_steps=1) if graphed else fwd_bwd
        losses = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for x in xs:
                losses.append(float(step(x)))
                opt.step()
                opt.zero_grad(set_to_none=False)
        msgs = [str(w.message) for w in seen if "graph_step" in str(w.message)]
        assert len(msgs) == (1 if graphed else 0) and "CUDA is not available" in "".join(msgs or ["CUDA is not available"])
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l0, w0), (l1, w1) = runs
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert abs(l0[-1] - l0[0]) > 1e-3 * abs(l0[0])  # the weights moved


def test_enabled_true_without_cuda_raises():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    model = _model(0)
    step = fp8tensor.graph_step(lambda x: model(x).sum().backward(), model.parameters(), enabled=True)
    with pytest.raises(RuntimeError, match="graph_step: cannot capture a CUDA graph: CUDA is not available"):
        step(torch.randn(2, 64))
    assert all(p.grad is None for p in model.parameters())  # nothing ran


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(fn=3), TypeError, "fn must be callable"),
    (dict(parameters=[1.0]), TypeError, "parameters must be tensors"),
    (dict(warmup_steps=0), ValueError, "warmup_steps must be an int >= 1"),
    (dict(warmup_steps=True), ValueError, "warmup_steps must be an int >= 1"),
])
def test_bad_arguments_raise(kwargs, err, match):
    args = dict(fn=lambda x: x, parameters=[torch.zeros(2)])
    args.update(kwargs)
    fn, params = args.pop("fn"), args.pop("parameters")
    with pytest.raises(err, match=f"graph_step: {match}"):
        fp8tensor.graph_step(fn, params, **args)


def _fwd_bwd_of(model):
    def fwd_bwd(x, scale=1.0):
        loss = model(x).square().mean() * scale
        loss.backward()
        return loss.detach()

    return fwd_bwd


def test_cpu_fallback_keeps_the_graph_contract():
    """Where the step runs eagerly (CPU), changed inputs and gradients set to None after the call that would capture
    raise as they do on a GPU, so a loop that passes on the CPU also runs captured."""
    import warnings

    model = _model(0)
    step = fp8tensor.graph_step(_fwd_bwd_of(model), model.parameters(), warmup_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        step(torch.randn(4, 64), scale=float("nan"))  # warm-up (NaN equals NaN as a constant argument)
    step(torch.randn(4, 64), scale=float("nan"))  # the call that would capture
    with pytest.raises(ValueError, match=r"graph_step: the inputs changed .*input leaf 0: \(\(4, 64\)"):
        step(torch.randn(5, 64), scale=float("nan"))
    with pytest.raises(ValueError, match="graph_step: the inputs changed"):
        step(torch.randn(4, 64), scale=2.0)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"set to None.*zero_grad\(set_to_none=False\)"):
        step(torch.randn(4, 64), scale=float("nan"))
    step.close()  # starts over: any shape again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        step(torch.randn(7, 64))
    free = fp8tensor.graph_step(_fwd_bwd_of(model), model.parameters(), enabled=False)  # no contract at all
    free(torch.randn(2, 64))
    free(torch.randn(3, 64))


def test_cpu_fallback_keeps_the_contract_after_the_capturing_call_raised():
    """A step that raises in the call that would capture takes no snapshot there (a failed capture captures
    nothing): the next successful call takes it, and gradients set to None after it still raise."""
    import warnings

    model = _model(0)
    fail = [False]

    def fwd_bwd(x):
        if fail[0]:
            raise KeyError("user error inside the step")
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach()

    step = fp8tensor.graph_step(fwd_bwd, model, warmup_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        step(torch.randn(4, 64))  # warm-up
    fail[0] = True
    with pytest.raises(KeyError, match="user error"):
        step(torch.randn(4, 64))  # the call that would capture
    fail[0] = False
    step(torch.randn(4, 64))  # captures (takes the snapshot)
    step(torch.randn(4, 64))
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"set to None"):
        step(torch.randn(4, 64))


@pytest.mark.parametrize("kwargs, match", [
    (dict(enabled="no"), "enabled must be None, True or False"),
    (dict(pool="junk"), "pool must be a graph memory pool handle"),
])
def test_bad_enabled_and_pool_raise(kwargs, match):
    model = _model(0)
    with pytest.raises(TypeError, match=f"graph_step: {match}"):
        fp8tensor.graph_step(_fwd_bwd_of(model), model.parameters(), **kwargs)


def test_not_a_model_nor_tensors_raises():
    model = _model(0)
    with pytest.raises(TypeError, match=r"graph_step: parameters must be the model \(an nn.Module\) or an iterable"):
        fp8tensor.graph_step(_fwd_bwd_of(model), 3)


def _moved_by(how: str, model: nn.Module) -> None:
    if how == "to":
        model.to(torch.float64)
    elif how == "data":
        p = model[0].bias
        p.data = p.data.clone()
    elif how == "assign":
        sd = {k: v.detach().clone() for k, v in nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32),
                                                                nn.Linear(32, 32, bias=False)).state_dict().items()}
        model.load_state_dict(sd, assign=True)
    elif how == "setattr":
        model[2].weight = nn.Parameter(torch.randn(32, 128))
    else:  # a whole submodule swapped
        model[2] = nn.Linear(128, 32)


def _captured_step(model: nn.Module):
    """``(step, calls)``: ``graph_step`` of ``model``'s forward + backward (one warm-up call, then the call that
    captures; on CPU both eager under the graph's contract) and the list its every run of the step appends to."""
    import warnings

    calls = []
    inner = _fwd_bwd_of(model)

    def fn(x, scale=1.0):
        calls.append(1)
        return inner(x, scale)

    step = fp8tensor.graph_step(fn, model, warmup_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        step(torch.randn(4, 64))  # warm-up
    step(torch.randn(4, 64))  # the call that would capture
    return step, calls


@pytest.mark.parametrize("how", ["to", "data", "assign", "setattr", "submodule"])
def test_cpu_fallback_refuses_parameters_moved_after_the_capture(how):
    """Parameters moved to new memory (``model.to``, ``p.data =``) or replaced in the model
    (``load_state_dict(assign=True)``, attribute assignment, a swapped submodule) after the capture raise at the next
    call, naming the cause and the remedy, before anything runs; ``close()`` then starts over on the model's current
    parameters (compared with a snapshot taken at capture; no heap search)."""
    import warnings

    model = _model(0, bias_free_tail=True)
    step, calls = _captured_step(model)
    step(torch.randn(4, 64))  # a replay: nothing moved
    _moved_by(how, model)
    n = len(calls)
    x = torch.randn(4, 64, dtype=torch.float64 if how == "to" else torch.float32)
    with pytest.raises(RuntimeError, match=r"graph_step: .*(other memory|replaced in their modules).*close\(\)"):
        step(x) if how != "to" else step(x.float())
    assert len(calls) == n, "the step ran on stale parameters"
    step.close()
    params = {id(p) for p in step.parameters}
    assert params == {id(p) for p in model.parameters()}, "close() did not take the model's current parameters"
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3):
            step(x)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("freeze", [True, False])
def test_cpu_fallback_refuses_requires_grad_changed_after_the_capture(freeze):
    """A parameter frozen (or unfrozen) after the capture raises at the next call, before anything runs: the captured
    backward would keep writing the frozen one's gradient (an optimizer would keep training it) and never the
    unfrozen one's. ``close()`` then captures again and the step trains what requires grad now."""
    import warnings

    model = _model(0, bias_free_tail=True)
    if not freeze:
        model[0].weight.requires_grad_(False)
    step, calls = _captured_step(model)
    model[0].weight.requires_grad_(not freeze)
    n = len(calls)
    with pytest.raises(RuntimeError,
                       match=r"graph_step: requires_grad of 1 of \d+ parameters \(0\.weight\) changed .*close\(\)"):
        step(torch.randn(4, 64))
    assert len(calls) == n, "the step ran with the capture's gradients"
    step.close()
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3):
            step(torch.randn(4, 64))
    assert (model[0].weight.grad is None) == freeze


def test_cpu_fallback_dtensor_parameters():
    """Tensor-parallel (DTensor) parameters pass the per-call checks (their inner tensors are compared, not their
    mesh, which torch >= 2.13 also lists in ``__tensor_flatten__``) and are refused when moved."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = _model(0, bias_free_tail=True)
        parallelize_module(model, mesh, {"0": ColwiseParallel()})
        step = fp8tensor.graph_step(_fwd_bwd_of(model), model.parameters(), warmup_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _ in range(4):
                step(torch.randn(4, 64))
        model.to(torch.float64)  # (DTensor parameters are swapped: new local tensors)
        with pytest.raises(RuntimeError, match="other memory"):
            step(torch.randn(4, 64))
    finally:
        if own:
            dist.destroy_process_group()



@pytest.mark.parametrize("how", ["to", "data"])
def test_cpu_fallback_given_parameters_refuses_moved_memory(how):
    """Given only the parameters (``model.parameters()``), memory moved after the capture is still refused."""
    import warnings

    model = _model(0, bias_free_tail=True)
    step = fp8tensor.graph_step(_fwd_bwd_of(model), model.parameters(), warmup_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3):
            step(torch.randn(4, 64))
    _moved_by(how, model)
    with pytest.raises(RuntimeError, match=r"graph_step: .*other memory.*close\(\)"):
        step(torch.randn(4, 64))


def _stepped(model, calls=None):
    """A graph_step over ``model`` (given as the model) past the call that would capture, and one more call."""
    import warnings

    inner = _fwd_bwd_of(model)

    def fn(x, scale=1.0):
        if calls is not None:
            calls.append(1)
        return inner(x, scale)

    step = fp8tensor.graph_step(fn, model, warmup_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3):
            step(torch.randn(4, 64))
    return step


def _with_buffer(seed: int) -> nn.Module:
    model = _model(seed, bias_free_tail=True)
    model[1].register_buffer("shift", torch.zeros(128))  # read by the step: GELU(x) + shift
    model[1].forward = lambda x, m=model[1]: nn.functional.gelu(x) + m.shift
    return model


@pytest.mark.parametrize("how", ["replaced", "data", "to"])
def test_buffers_replaced_or_moved_after_the_capture_raise(how):
    """With the model given, the graph reads its buffers too: a buffer replaced (``module.buf = t``) or moved
    (``buf.data = ...``, ``model.to``) after the capture would be ignored by every replay, so the next call raises
    (naming the buffer) before anything runs; in-place buffer updates pass."""
    model = _with_buffer(0)
    calls = []
    step = _stepped(model, calls)
    model[1].shift.add_(1.0)  # in place: fine (the graph reads the same memory)
    step(torch.randn(4, 64))
    n = len(calls)
    if how == "replaced":
        model[1].shift = torch.ones(128)
        match = r"buffers 1\.shift were replaced in their modules"
    elif how == "data":
        model[1].shift.data = torch.ones(128)
        match = "parameters and buffers now live in other memory"
    else:
        model.to(torch.float64)
        match = "other memory"
    with pytest.raises(RuntimeError, match=match):
        step(torch.randn(4, 64))  # (the checks run before the step, whatever its inputs' dtype needs now)
    assert len(calls) == n, "the step ran on a stale buffer"


def test_a_swapped_submodule_without_parameters_raises():
    """Swapping a parameter-free submodule (the activation) changes what the step computes but no parameter: the
    snapshot of each module's children sees it; the message names it."""
    model = _model(0, bias_free_tail=True)
    step = _stepped(model)
    model[1] = nn.ReLU()
    with pytest.raises(RuntimeError, match=r"submodules 1 were replaced in their modules \(model\.layer = \.\.\.\)"):
        step(torch.randn(4, 64))
    step.close()  # starts over on the model as it is now
    _stepped(model)  # (warm-up, capture call and one more: no error)


def test_a_deep_replacement_names_every_replaced_parameter():
    model = nn.Sequential(nn.Sequential(_model(0)), nn.Linear(32, 64))
    fp8tensor.convert_to_fp8(model)
    step = _stepped(model)
    inner = model[0][0]
    inner[0].weight = nn.Parameter(inner[0].weight.detach().clone())
    inner[2].bias = nn.Parameter(inner[2].bias.detach().clone())
    with pytest.raises(RuntimeError, match=r"parameters 0\.0\.0\.weight, 0\.0\.2\.bias were replaced"):
        step(torch.randn(4, 64))


def test_the_checks_never_search_the_heap(monkeypatch):
    """The per-call checks compare a snapshot: no ``gc`` heap walk (which took most of a second on a large heap)."""
    import gc

    def refuse(*a, **k):
        raise AssertionError("graph_step searched the heap")

    monkeypatch.setattr(gc, "get_referrers", refuse)
    monkeypatch.setattr(gc, "get_objects", refuse)
    model = _model(0)
    step = _stepped(model)
    step(torch.randn(4, 64))
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    with pytest.raises(RuntimeError, match=r"parameters 0\.weight were replaced"):
        step(torch.randn(4, 64))


def test_cpu_step_takes_equal_numpy_values_again():
    """A non-tensor input of equal value on a later call (numpy scalars and arrays, whose ``==`` gives ``np.bool_``
    or an array) is the same input: the step runs; a changed value or shape still raises."""
    import warnings

    np = pytest.importorskip("numpy")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the step would be captured (tests/gpu/test_gpu_graph_step.py)")
    model = _model(0)

    def fwd_bwd(x, s, a):
        loss = model(x).square().mean() * float(s) * float(a.sum())
        loss.backward()
        return loss.detach()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        step = fp8tensor.graph_step(fwd_bwd, model)
        x = torch.randn(16, 64)
        step(x, np.float32(0.5), np.array([1.0, 2.0]))
        step(x, np.float32(0.5), np.array([1.0, 2.0]))  # (equal values, new objects)
        with pytest.raises(ValueError, match="graph_step: the inputs changed"):
            step(x, np.float32(0.25), np.array([1.0, 2.0]))
        with pytest.raises(ValueError, match="graph_step: the inputs changed"):
            step(x, np.float32(0.5), np.array([1.0, 2.0, 3.0]))
