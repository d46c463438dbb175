"""FSDP2 over a 1-rank mesh: a parameter group's master weights quantized together (one launch on CUDA; on CPU the
same code path with per-weight quantization) and the packed ``local`` payload give the same training, bit for bit,
as quantizing each weight in its own hook; kept results are never served after an optimizer step."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

STEPS = 3


def spawn(fn_name: str, world: int, out_dir) -> list[dict]:
    from _spawn import spawn as run

    return run(__name__, fn_name, world, out_dir)


def _train(seed: int, reshard: bool, grouped: bool, compiled: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fp8tensor
    from fp8tensor import fsdp as payload

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 48, bias=False), nn.Linear(48, 64, bias=False))
    fp8tensor.convert_to_fp8(model)
    if compiled:
        for m in model:
            m.compile()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed + 1)
    finder = payload.fsdp_group
    if not grouped:  # no group found: each weight quantized in its own hook call
        payload.fsdp_group = lambda local: (None, [])
    out = dict(y=[], grads=[], params=[], shared_storage=[])
    def record(mod, args):
        # during forward the Linear holds FSDP2's unsharded fp8 weight: with the packed local payload its data and
        # scales view one buffer
        w = mod.weight.to_local() if hasattr(mod.weight, "to_local") else mod.weight
        out["shared_storage"].append(w.qdata.untyped_storage().data_ptr() == w.scale.untyped_storage().data_ptr())

    model[1].register_forward_pre_hook(record)
    try:
        for _ in range(STEPS):
            x = torch.randn(4, 8, 64, generator=gen)
            g = torch.randn(4, 8, 64, generator=gen)
            y = model(x)
            y.backward(g)
            out["y"].append(y.detach().clone())
            out["grads"].append([p.grad.to_local().clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            out["params"].append([p.to_local()._data.clone() for p in model.parameters()])
    finally:
        payload.fsdp_group = finder
    return out


def worker_group(rank: int, world: int, seed: int) -> dict:
    res = {}
    for reshard in (False, True):
        res[f"grouped_{reshard}"] = _train(seed, reshard, grouped=True)
        res[f"single_{reshard}"] = _train(seed, reshard, grouped=False)
    res["seed"] = seed
    return res


def worker_compiled(rank: int, world: int, seed: int) -> dict:
    torch._dynamo.reset()
    res = dict(grouped=_train(seed, False, grouped=True, compiled=True))
    torch._dynamo.reset()
    res["single"] = _train(seed, False, grouped=False, compiled=True)
    res["seed"] = seed
    return res


@pytest.fixture(scope="module")
def run1(tmp_path_factory):
    return spawn("worker_group", 1, tmp_path_factory.mktemp("fsdp_group"))


@pytest.fixture(scope="module")
def run1_compiled(tmp_path_factory):
    return spawn("worker_compiled", 1, tmp_path_factory.mktemp("fsdp_group_compiled"))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("reshard", [False, True])
def test_grouped_quantization_is_bit_identical(run1, reshard):
    (r,) = run1
    g, s = r[f"grouped_{reshard}"], r[f"single_{reshard}"]
    for key in ("y", "grads", "params"):
        assert _equal(g[key], s[key]), (key, r["seed"])
    # the weights changed between steps, so a stale kept result would have shown up as a different output
    assert not torch.equal(g["y"][0], g["y"][1])
    assert all(g["shared_storage"]) and all(s["shared_storage"])


def test_grouped_quantization_compiled(run1_compiled):
    """Compiled Linears read the packed payload's data and scales (two views of one buffer) as graph inputs."""
    (r,) = run1_compiled
    for key in ("y", "grads", "params"):
        assert _equal(r["grouped"][key], r["single"][key]), (key, r["seed"])
    assert all(r["grouped"]["shared_storage"])


@pytest.mark.parametrize("packed", [False, True])
def test_kept_result_not_served_after_update(packed):
    """The first hook call of a group quantizes every weight and keeps the others' results; a weight updated in
    place before its own call (version bump) is quantized again, from its new values."""
    from fp8tensor import fsdp as payload
    from fp8tensor.master import Fp8MasterWeight
    from fp8tensor.quantize import quantize

    torch.manual_seed(0)
    ws = [Fp8MasterWeight(torch.randn(n, 32)) for n in (16, 24, 8)]
    finder, payload.fsdp_group = payload.fsdp_group, lambda local: (None, ws)  # ws stands for the FSDP2 group
    try:
        def hook(w):
            hit = payload._quantized_rows(w, torch.float8_e4m3fn, packed)
            assert hit is not None and (hit[2] is not None) == packed
            return hit[0], hit[1]

        hook(ws[0])  # quantizes all three, keeps ws[1] and ws[2]
        with torch.no_grad():
            ws[1]._data.mul_(3.0)  # an optimizer step in between
        for w in ws[1:]:
            q, s = hook(w)
            qr, sr = quantize(w._data, -1)
            assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    finally:
        payload.fsdp_group = finder


def test_local_group_payload_layout_and_kept_results():
    """The 1-rank payload of a group (one buffer) holds every weight's fp8 bytes and scales exactly as
    :func:`pack` of :func:`quantize` would (zero padding included); a weight updated before its own hook call is
    quantized again; a group of new shapes gets its own layout."""
    from fp8tensor import fsdp as payload
    from fp8tensor.master import Fp8MasterWeight
    from fp8tensor.quantize import quantize

    torch.manual_seed(0)
    ws = [Fp8MasterWeight(torch.randn(n, k)) for n, k in ((16, 32), (5, 24), (8, 3))]  # odd sizes: padding bytes
    finder, payload.fsdp_group = payload.fsdp_group, lambda local: (None, ws)
    try:
        for round_ in range(2):
            first = payload._quantized_rows(ws[0], torch.float8_e4m3fn, True)
            with torch.no_grad():
                ws[2]._data.mul_(3.0)  # updated before its own call: its kept result must not be served
            got = [first] + [payload._quantized_rows(w, torch.float8_e4m3fn, True) for w in ws[1:]]
            for w, (q, s, buf) in zip(ws, got):
                qr, sr = quantize(w._data, -1)
                assert torch.equal(buf, payload.pack(qr, sr))  # data, scales and zero padding, byte for byte
                assert q.data_ptr() == buf.data_ptr() and torch.equal(s, sr)
            assert got[1][2].untyped_storage().data_ptr() == got[0][2].untyped_storage().data_ptr()
        ws.append(Fp8MasterWeight(torch.randn(4, 16)))  # a new layout
        got = [payload._quantized_rows(w, torch.float8_e4m3fn, True) for w in ws]
        for w, (_, _, buf) in zip(ws, got):
            qr, sr = quantize(w._data, -1)
            assert torch.equal(buf, payload.pack(qr, sr))
    finally:
        payload.fsdp_group = finder


def test_pre_all_gather_hook_signature_is_prebuilt():
    """FSDP2 reads ``inspect.signature(local.fsdp_pre_all_gather)`` before every call: the hook hands back one
    prebuilt 5-argument signature (no new ``Signature`` per call) and calls through to the method."""
    import inspect

    from fp8tensor import ScaledFp8Tensor
    from fp8tensor.master import Fp8MasterWeight

    for t in (Fp8MasterWeight(torch.randn(8, 16)), ScaledFp8Tensor.from_hp(torch.randn(8, 16))):
        sig = inspect.signature(t.fsdp_pre_all_gather)
        assert list(sig.parameters) == ["mesh", "outer_size", "outer_stride", "module", "mp_policy"]
        assert inspect.signature(t.fsdp_pre_all_gather) is sig
        assert hasattr(t, "fsdp_pre_all_gather") and callable(type(t).fsdp_pre_all_gather)
    # calls reach the method (its own input check), for both classes
    with pytest.raises(NotImplementedError, match="Fp8MasterWeight.fsdp_pre_all_gather"):
        Fp8MasterWeight(torch.randn(8)).fsdp_pre_all_gather(None, (8,), (1,), None, None)
    with pytest.raises(NotImplementedError, match="ScaledFp8Tensor.fsdp_pre_all_gather"):
        ScaledFp8Tensor.from_hp(torch.randn(8, 16))[0].fsdp_pre_all_gather(None, (16,), (1,), None, None)


def test_kept_result_not_served_after_data_swap():
    """A kept group result belongs to the data it was computed from: after ``w.data = new`` (a new ``_data``) the
    weight is quantized again."""
    from fp8tensor import fsdp as payload
    from fp8tensor.master import Fp8MasterWeight
    from fp8tensor.quantize import quantize

    ws = [Fp8MasterWeight(torch.randn(n, 32)) for n in (16, 24)]
    finder, payload.fsdp_group = payload.fsdp_group, lambda local: (None, ws)
    try:
        payload._quantized_rows(ws[0], torch.float8_e4m3fn, False)
        ws[1].data = torch.randn(24, 32)
        q, s, _ = payload._quantized_rows(ws[1], torch.float8_e4m3fn, False)
        qr, sr = quantize(ws[1]._data, -1)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    finally:
        payload.fsdp_group = finder


def worker_kept_results(rank: int, world: int, seed: int) -> dict:
    """A round interrupted after the group's first hook, then an optimizer step / ``load_state_dict`` / a switch of
    one weight's fp8 format: the later weights' hooks must give their *current* quantization."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fp8tensor
    from fp8tensor import Recipe
    from fp8tensor.recipes import weight_format
    from fp8tensor.quantize import quantize

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 48, bias=False), nn.Linear(48, 64, bias=False))
    fp8tensor.convert_to_fp8(model)
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    state = model._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
    A, B, C = [fp._sharded_local_tensor for fp in groups[0].fsdp_params]

    def hook(w):
        return w.fsdp_pre_all_gather(mesh, w.shape, w.stride(), None, None)

    def payload_matches(w) -> bool:
        (buf,), meta = hook(w)
        q = buf[: w.numel()].view(meta.float8_dtype).view(w.shape)
        qr, _ = quantize(w._data, -1, meta.float8_dtype)
        return meta.float8_dtype == w.recipe.float8_dtype and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))

    res = {}
    versions = [B._data._version]
    hook(A)  # keeps B's and C's results
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    versions.append(B._data._version)
    res["after_step"] = payload_matches(B) and payload_matches(C)
    hook(A)
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})
    res["after_load"] = payload_matches(B) and payload_matches(C)
    hook(A)
    B.recipe = weight_format(Recipe("rowwise_e5m2"), torch.float8_e5m2)
    hook(A)  # a new round that leaves B out (another format)
    res["after_format_switch"] = payload_matches(B)
    res["versions"] = versions
    res["seed"] = seed
    return res


def test_kept_results_track_updates_through_fsdp2(tmp_path):
    """Updates that reach the master through FSDP2's sharded DTensor (optimizer step, ``load_state_dict``) bump its
    data's version, so a kept group result is never served after them; nor across an fp8 format switch."""
    (r,) = spawn("worker_kept_results", 1, tmp_path)
    assert r["versions"][1] > r["versions"][0], r
    assert r["after_step"] and r["after_load"] and r["after_format_switch"], r


def test_compiled_master_pre_all_gather_hook():
    """``torch.compile`` of code calling a master's ``fsdp_pre_all_gather`` traces it (each weight quantized on its
    own while tracing) and gives the eager result."""
    from fp8tensor.master import Fp8MasterWeight

    class Mesh:  # a 2-rank shard mesh as the hook sees it (no collective in the even mode)
        def size(self):
            return 2

    w = Fp8MasterWeight(torch.randn(8, 16))
    fn = lambda t: t.fsdp_pre_all_gather(Mesh(), (16, 16), (16, 1), None, None)[0][0].float().sum()  # noqa: E731
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="aot_eager")(w), fn(w))
    torch._dynamo.reset()
