"""Checkpoints of fp8tensor models under FSDP2 + tensor parallelism (``torch.distributed.checkpoint``, DCP).

One spawn of 4 gloo ranks saves on a ``dp=2 x tp=2`` mesh and loads on other meshes; this process then loads the
same checkpoints without any process group. Checked:

* a ``convert_to_fp8`` model (high-precision masters; its state dict holds plain tensors): DCP save on 2 x 2,
  load on 2 x 2 (model + AdamW state: the resumed step is bit-identical), on a 1-D mesh of 4 and in a single
  process gives bit-identical master weights; ``torch.load(weights_only=True)`` of a full state dict;
* a ``quantize_weights`` model (ScaledFp8Tensor weights): its fp8 data and scales are saved as they are and load
  back bit-exactly on 2 x 2, on 4, in a single process, and as exact dequantized values into a high-precision
  model; ``torch.load(weights_only=True)`` of its state dict and of ``dcp_to_torch_save``'s file.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from conftest import same_fp8  # noqa: E402


# ============================================================================================ spawn harness
def spawn(world: int, out_dir) -> list[dict]:
    """Run :func:`worker` on ``world`` gloo processes (``tests/distributed/_spawn.py``)."""
    from _spawn import spawn as run

    return run(__name__, "worker", world, out_dir, extra=(Path(out_dir),))


# ============================================================================================ helpers
def make_base(seed: int):
    from _llama_block import BlockConfig, LlamaBlock

    torch.manual_seed(seed)
    return LlamaBlock(BlockConfig(n_heads=4, head_dim=16, ffn=96))


def linear_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def tp_slice(t, name: str, tp_rank: int):
    """The tensor-parallel shard of a full ScaledFp8Tensor weight as tp_plan places it (wo/w2 row-wise: columns,
    the rest column-wise: rows); row scales follow the rows and are shared by column slices."""
    from fp8tensor import ScaledFp8Tensor

    if name.endswith(("wo", "w2")):
        return ScaledFp8Tensor(torch.chunk(t.qdata, 2, 1)[tp_rank], t.scale, t.orig_dtype)
    return ScaledFp8Tensor(torch.chunk(t.qdata, 2, 0)[tp_rank], torch.chunk(t.scale, 2, 0)[tp_rank], t.orig_dtype)


def full_params(model) -> dict:
    """Full high-precision parameters (DTensors gathered, masters unwrapped), from the state dict."""
    from fp8tensor.tensor import _is_dtensor

    return {k: (v.full_tensor() if _is_dtensor(v) else v).detach().clone() for k, v in model.state_dict().items()}


def build(base, order: str, mesh=None, dp_mesh=None):
    """Apply in ``order``: c convert_to_fp8, q quantize_weights, t parallelize_module (tp), f fully_shard."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from _llama_block import tp_plan
    from fp8tensor import convert_to_fp8, quantize_weights

    m = copy.deepcopy(base)
    for step in order:
        if step == "c":
            convert_to_fp8(m)
        elif step == "q":
            quantize_weights(m)
        elif step == "t":
            parallelize_module(m, mesh["tp"], tp_plan(False))
        elif step == "f":
            dpm = dp_mesh if dp_mesh is not None else mesh["dp"]
            fully_shard(m.attention, mesh=dpm)
            fully_shard(m.feed_forward, mesh=dpm)
            fully_shard(m, mesh=dpm)
    return m


def unshard_all(model, unshard: bool = True) -> None:
    """(Un)shard every FSDP2 module of ``model`` (``FSDPModule.unshard`` only gathers its own group)."""
    from torch.distributed.fsdp import FSDPModule

    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.unshard() if unshard else mod.reshard()


def train_step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# ============================================================================================ worker
def worker(rank: int, world: int, out: Path, seed: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from fp8tensor import ScaledFp8Tensor

    res: dict = {"seed": seed}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh4 = init_device_mesh("cpu", (world,))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    base = make_base(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(2, 8, 64, generator=gen) for _ in range(4)]  # [dp0 step0, dp1 step0, dp0 step1, dp1 step1]

    # ---------------------------------------------- master-weight model: save on 2 x 2 after one AdamW step
    m = build(base, "tfc", mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    train_step(m, opt, xs[dp])
    msd, osd = get_state_dict(m, opt)
    res["master_sd_locals"] = sorted({type(v.to_local()).__name__ for v in msd.values()})
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out / "master")
    saved = full_params(m)
    full_sd = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(saved, out / "master_full.pt")
        torch.save(full_sd, out / "master_full_sd.pt")
    train_step(m, opt, xs[2 + dp])
    after = full_params(m)

    # load on 2 x 2 (fresh weights, model + optimizer) and resume one step: bit-identical to not stopping
    m2 = build(make_base(seed + 100), "ctf", mesh)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1)
    train_step(m2, opt2, xs[dp])  # creates optimizer state to load into
    msd2, osd2 = get_state_dict(m2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=out / "master")
    set_state_dict(m2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    loaded = full_params(m2)
    res["load_2x2_equal"] = all(torch.equal(loaded[k], saved[k]) for k in saved)
    res["load_2x2_locals"] = sorted({type(p.to_local()).__name__ for p in m2.parameters() if p.dim() == 2})
    train_step(m2, opt2, xs[2 + dp])
    resumed = full_params(m2)
    res["resume_equal"] = all(torch.equal(resumed[k], after[k]) for k in after)

    # load on a 1-D mesh of 4 (dp=4, no TP)
    m4 = build(make_base(seed + 200), "fc", dp_mesh=mesh4)
    sd4 = m4.state_dict()
    dcp.load({"model": sd4}, checkpoint_id=out / "master")  # the model part of the model + optimizer checkpoint
    m4.load_state_dict(sd4)
    loaded4 = full_params(m4)
    res["load_dp4_equal"] = all(torch.equal(loaded4[k], saved[k]) for k in saved)
    res["load_dp4_locals"] = sorted({type(p.to_local()).__name__ for p in m4.parameters() if p.dim() == 2})

    # ---------------------------------------------- ScaledFp8Tensor model: quantized, then TP + FSDP
    expected = {n: ScaledFp8Tensor.from_hp(base.get_submodule(n).weight.detach()) for n in linear_names(base)}
    q = build(base, "qtf", mesh)
    qsd = q.state_dict()
    res["fp8_sd_locals"] = sorted({type(qsd[n + ".weight"].to_local()).__name__ for n in expected})
    dcp.save(qsd, checkpoint_id=out / "fp8")
    with torch.no_grad():
        y_q = q(xs[dp])

    # load on 2 x 2 into a model quantized from other weights
    q2 = build(make_base(seed + 300), "qtf", mesh)
    q2sd = q2.state_dict()
    dcp.load(q2sd, checkpoint_id=out / "fp8")
    q2.load_state_dict(q2sd)
    unshard_all(q2)
    res["fp8_2x2_exact"] = {n: same_fp8(q2.get_submodule(n).weight.to_local(), tp_slice(expected[n], n, tp))
                            for n in expected}
    unshard_all(q2, False)
    with torch.no_grad():
        res["fp8_2x2_forward_equal"] = bool(torch.equal(q2(xs[dp]), y_q))

    # load on dp=4
    q4 = build(make_base(seed + 400), "qf", dp_mesh=mesh4)
    q4sd = q4.state_dict()
    dcp.load(q4sd, checkpoint_id=out / "fp8")
    q4.load_state_dict(q4sd)
    unshard_all(q4)
    res["fp8_dp4_exact"] = {n: same_fp8(q4.get_submodule(n).weight, expected[n]) for n in expected}
    unshard_all(q4, False)
    return res


# ============================================================================================ tests
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    return spawn(4, out), out


def test_master_state_dict_is_plain(ckpt):
    """A converted model's state dict holds plain high-precision local tensors (loadable without fp8tensor)."""
    for r in ckpt[0]:
        assert r["master_sd_locals"] == ["Tensor"], r["master_sd_locals"]


def test_master_load_2x2_and_resume(ckpt):
    """Save on dp=2 x tp=2, load model + AdamW state into a fresh 2 x 2 model: identical weights, master shards
    still Fp8MasterWeight, and the next step is bit-identical to the run that never stopped."""
    for r in ckpt[0]:
        assert r["load_2x2_equal"] and r["load_2x2_locals"] == ["Fp8MasterWeight"], (r["load_2x2_locals"], r["seed"])
        assert r["resume_equal"], f"resumed step differs (seed {r['seed']})"


def test_master_load_dp4(ckpt):
    """Save on dp=2 x tp=2, load on a 1-D mesh of 4: bit-identical master weights."""
    for r in ckpt[0]:
        assert r["load_dp4_equal"] and r["load_dp4_locals"] == ["Fp8MasterWeight"], (r["load_dp4_locals"], r["seed"])


def test_master_load_single_process(ckpt):
    """Load the 2 x 2 checkpoint without any process group into a plain converted model: identical weights;
    the full state dict saved with torch.save loads with weights_only=True."""
    import torch.distributed.checkpoint as dcp

    from fp8tensor import Fp8MasterWeight, convert_to_fp8

    res, out = ckpt
    saved = torch.load(out / "master_full.pt", weights_only=True)
    m = convert_to_fp8(make_base(res[0]["seed"] + 500))
    sd = m.state_dict()
    dcp.load({"model": sd}, checkpoint_id=out / "master")
    m.load_state_dict(sd)
    assert all(type(m.get_submodule(n).weight) is Fp8MasterWeight for n in linear_names(m))
    got = m.state_dict()
    assert sorted(got) == sorted(saved)
    for k in saved:
        assert torch.equal(got[k], saved[k]), k
    full_sd = torch.load(out / "master_full_sd.pt", weights_only=True)
    assert sorted(full_sd) == sorted(saved)
    m2 = convert_to_fp8(make_base(res[0]["seed"] + 600))
    m2.load_state_dict(full_sd)
    for k, v in m2.state_dict().items():
        assert type(v) is torch.Tensor and torch.equal(v, saved[k]), k


def test_fp8_weights_load_exact(ckpt):
    """ScaledFp8Tensor weights (quantize_weights, then TP + FSDP2): fp8 bits and scales load back exactly on
    2 x 2 and on dp=4; the reloaded 2 x 2 model's forward is bit-identical."""
    for r in ckpt[0]:
        assert r["fp8_sd_locals"] == ["ScaledFp8Tensor"], r["fp8_sd_locals"]
        assert len(r["fp8_2x2_exact"]) == 7 and all(r["fp8_2x2_exact"].values()), (r["fp8_2x2_exact"], r["seed"])
        assert r["fp8_2x2_forward_equal"], r["seed"]
        assert len(r["fp8_dp4_exact"]) == 7 and all(r["fp8_dp4_exact"].values()), (r["fp8_dp4_exact"], r["seed"])


def test_fp8_weights_single_process(ckpt, tmp_path):
    """The sharded fp8 checkpoint in one process: into a quantized model bit-exactly, into a high-precision model
    as the exact dequantized values; torch.save's file loads (weights_only=True) as ScaledFp8Tensors,
    dcp_to_torch_save's as the exact dequantized values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from fp8tensor import ScaledFp8Tensor, quantize_weights

    res, out = ckpt
    seed = res[0]["seed"]
    base = make_base(seed)
    expected = {n: ScaledFp8Tensor.from_hp(base.get_submodule(n).weight.detach()) for n in linear_names(base)}

    q = quantize_weights(make_base(seed + 700))
    sd = q.state_dict()
    dcp.load(sd, checkpoint_id=out / "fp8")
    q.load_state_dict(sd)
    for n in expected:
        assert same_fp8(q.get_submodule(n).weight, expected[n]), n

    hp = make_base(seed + 800)
    sd = hp.state_dict()
    dcp.load(sd, checkpoint_id=out / "fp8")
    hp.load_state_dict(sd)
    for n in expected:
        assert torch.equal(hp.get_submodule(n).weight.detach(), expected[n].to_hp()), n

    torch.save(q.state_dict(), tmp_path / "q.pt")
    back = torch.load(tmp_path / "q.pt", weights_only=True)
    for n in expected:
        assert same_fp8(back[n + ".weight"], expected[n]), n

    # dcp_to_torch_save allocates plain tensors from the checkpoint metadata (the logical dtype): it writes the
    # exact dequantized values
    dcp_to_torch_save(out / "fp8", tmp_path / "fp8_full.pt")
    full = torch.load(tmp_path / "fp8_full.pt", weights_only=True)
    for n in expected:
        assert torch.equal(full[n + ".weight"], expected[n].to_hp()), n
