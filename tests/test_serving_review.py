"""Serving-path review: a ``quantize_weights`` model given high-precision weights holding an inf or NaN, through
``load_state_dict`` (``assign=True`` or not), ``copy_`` or ``.data =``, raises a ``ValueError`` naming the rows (as
``quantize_weights`` and ``ScaledFp8Tensor.from_hp`` do: quantized, each such row would be all NaN) and leaves the
module's weight, bias and outputs as they were; finite values written the same ways are seen by the next call, within
the fp8 bound of a float64 reference."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import ScaledFp8Tensor
from conftest import E4M3_GEMM_BOUND, rel_err, same_bits

MODES = ("no_grad", "inference_mode", "grad")


def _run(model, x, mode):
    if mode == "no_grad":
        with torch.no_grad():
            return model(x)
    if mode == "inference_mode":
        with torch.inference_mode():
            return model(x)
    return model(x).detach()


def _model(dtype=torch.bfloat16):
    return fp8tensor.quantize_weights(nn.Sequential(nn.Linear(64, 48).to(dtype)))


def _snapshot(lin):
    return lin.weight.qdata.view(torch.uint8).clone(), lin.weight.scale.clone(), lin.bias.detach().clone()


def _unchanged(lin, snap) -> bool:
    w = lin.weight
    return (type(w) is ScaledFp8Tensor and torch.equal(w.qdata.view(torch.uint8), snap[0])
            and torch.equal(w.scale, snap[1]) and torch.equal(lin.bias.detach(), snap[2]))


def _bad_weight(dtype, value):
    w = torch.randn(48, 64, dtype=dtype)
    w[5, 7] = value
    w[30, 0] = value
    return w


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_of_nonfinite_weights_raises_and_changes_nothing(value, assign, mode):
    model = _model()
    lin = model[0]
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    y0 = _run(model, x, mode)
    snap = _snapshot(lin)
    state = {"0.weight": _bad_weight(torch.bfloat16, value), "0.bias": torch.zeros(48, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"load_state_dict \('0\.weight'\): inf or NaN in 2 row\(s\).*rows \[5, 30\]"):
        model.load_state_dict(state, assign=assign)
    assert _unchanged(lin, snap)  # (with assign=True the bf16 weight used to stay in the model, the bias zeroed)
    assert same_bits(_run(model, x, mode), y0)


@pytest.mark.parametrize("how", ["copy_", "data.copy_", "data ="])
def test_nonfinite_writes_into_an_fp8_weight_raise_and_change_nothing(how):
    model = _model()
    lin = model[0]
    snap = _snapshot(lin)
    bad = _bad_weight(torch.bfloat16, float("nan"))
    with pytest.raises(ValueError, match=r"ScaledFp8Tensor( copy_|\.data = \.\.\.): inf or NaN in 2 row\(s\)"), \
            torch.no_grad():
        if how == "copy_":
            lin.weight.copy_(bad)
        elif how == "data.copy_":
            lin.weight.data.copy_(bad)
        else:
            lin.weight.data = bad
    assert _unchanged(lin, snap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_finite_weights_written_are_seen_by_the_next_call(dtype, assign, mode):
    model = _model(dtype)
    x = torch.randn(2, 3, 64, dtype=dtype)
    _run(model, x, mode)  # a first call before the writes: nothing of it may be reused
    w2, b2 = torch.randn(48, 64, dtype=dtype), torch.randn(48, dtype=dtype)
    model.load_state_dict({"0.weight": w2, "0.bias": b2}, assign=assign)
    assert type(model[0].weight) is ScaledFp8Tensor
    ref = x.double() @ w2.double().t() + b2.double()
    assert rel_err(_run(model, x, mode), ref) < E4M3_GEMM_BOUND
    w3 = torch.randn(48, 64, dtype=dtype)
    with torch.no_grad():
        model[0].weight.copy_(w3)
    assert rel_err(_run(model, x, mode), x.double() @ w3.double().t() + b2.double()) < E4M3_GEMM_BOUND
    w4 = torch.randn(48, 64, dtype=dtype)
    model[0].weight.data = w4
    assert rel_err(_run(model, x, mode), x.double() @ w4.double().t() + b2.double()) < E4M3_GEMM_BOUND


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1e-3])
@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("conversion", ["quantize_weights", "convert_to_fp8"])
def test_plain_layout_scales_not_finite_and_positive_raise_and_change_nothing(bad, assign, conversion):
    """A plain-layout checkpoint (``weight`` fp8 + ``weight_scale``) is checked as the public ``ScaledFp8Tensor``
    constructor checks its parts: a NaN scale used to load as an all-NaN row, 0 as zeros, a negative one flipped it."""
    src = _model()
    with fp8tensor.config(state_dict_fp8="plain"):
        state = src.state_dict()
    state["0.weight_scale"] = state["0.weight_scale"].clone()
    state["0.weight_scale"][11, 0] = bad
    model = getattr(fp8tensor, conversion)(nn.Sequential(nn.Linear(64, 48).to(torch.bfloat16)))
    lin = model[0]
    w_type = type(lin.weight)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y0 = model(x)
    with pytest.raises(ValueError, match=r"load_state_dict \('0\.weight' \+ '0\.weight_scale'\): scale must be finite "
                                         r"and positive .* at index \(11, 0\) \(1 bad of 48\)"):
        model.load_state_dict(state, assign=assign)
    assert type(lin.weight) is w_type
    after = model.state_dict()
    for k, v in before.items():
        if type(v) is ScaledFp8Tensor:
            assert torch.equal(after[k].qdata.view(torch.uint8), v.qdata.view(torch.uint8))
            assert torch.equal(after[k].scale, v.scale)
        else:
            assert torch.equal(after[k], v), k
    with torch.no_grad():
        assert same_bits(model(x), y0)


@pytest.mark.parametrize("assign", [False, True])
def test_plain_layout_round_trip_is_bit_exact_and_seen_by_the_next_call(assign):
    src, model = _model(), _model()
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        model(x)
    with fp8tensor.config(state_dict_fp8="plain"):
        state = src.state_dict()
    model.load_state_dict(state, assign=assign)
    with torch.no_grad():
        assert same_bits(model(x), src(x))
    w = src[0].weight
    ref = x.double() @ (w.qdata.double() * w.scale.double()).t() + src[0].bias.double()
    with torch.no_grad():
        assert rel_err(model(x), ref) < E4M3_GEMM_BOUND


@pytest.mark.parametrize("tie", [False, True])
def test_hugging_face_checkpoint_of_a_tied_model_loads_bit_for_bit(tmp_path, tie):
    """``save_pretrained`` writes one name of tied parameters (``model.embed_tokens.weight``, not ``lm_head.weight``):
    ``load_safetensors`` used to fail with ``Missing key(s) in state_dict: "lm_head.weight"`` for every tied model."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                   tie_word_embeddings=tie)

    def build(keep=None):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        if keep is not None:
            keep.append(copy.deepcopy(m).double())  # the float64 reference: the high-precision weights
        with pytest.warns(UserWarning, match="lm_head") if tie else contextlib.nullcontext():
            return fp8tensor.quantize_weights(m)

    hp = []
    model = build(hp)
    with fp8tensor.config(state_dict_fp8="plain"):
        model.save_pretrained(tmp_path)
    loaded = build()
    assert not torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    fp8tensor.load_safetensors(loaded, tmp_path)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        y = loaded(ids).logits
        assert same_bits(y, model(ids).logits)
    with torch.no_grad():  # five fp8 GEMMs in series (attention: v, o; MLP: up, down; head): errors in quadrature
        assert rel_err(y, hp[0](ids).logits) < 5**0.5 * E4M3_GEMM_BOUND


def test_safetensors_save_model_of_linears_sharing_an_fp8_weight_loads(tmp_path):
    """``safetensors.torch.save_model`` keeps one name of shared tensors (``a.weight`` + ``a.weight_scale``): the
    Linear sharing it loads from that entry (it used to be a missing key)."""
    st = pytest.importorskip("safetensors.torch")

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    model = fp8tensor.quantize_weights(Shared())
    with fp8tensor.config(state_dict_fp8="plain"):
        st.save_model(model, str(tmp_path / "m.safetensors"))
    loaded = fp8tensor.quantize_weights(Shared())
    fp8tensor.load_safetensors(loaded, tmp_path)
    assert loaded.a.weight is loaded.b.weight
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert same_bits(loaded(x), model(x))
    w = model.a.weight
    wd = w.qdata.double() * w.scale.double()
    ref = torch.relu(x.double() @ wd.t()) @ wd.t()
    with torch.no_grad():
        assert rel_err(loaded(x), ref) < 2**0.5 * E4M3_GEMM_BOUND  # (activations rounded at both GEMMs)


def _state_bits(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        t = v.qdata.view(torch.uint8) if type(v) is ScaledFp8Tensor else v
        out[k] = t.detach().clone()
        if type(v) is ScaledFp8Tensor:
            out[k + "/scale"] = v.scale.clone()
    return out


@pytest.mark.parametrize("assign", [False, True])
def test_a_refused_entry_of_a_later_layer_leaves_the_whole_model_unchanged(assign):
    """``load_state_dict`` of a three-layer ``quantize_weights`` model whose last layer's entry holds a NaN: raises
    naming that key, and no layer changes (the checks run for every fp8 module before any loads: the first layers
    used to hold the new checkpoint's values, the others the old ones, a mix of two checkpoints)."""
    torch.manual_seed(0)
    model = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 48), nn.Linear(48, 32)))
    before = _state_bits(model)
    state = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    state["2.weight"][3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"load_state_dict \('2\.weight'\): inf or NaN in 1 row\(s\)"):
        model.load_state_dict(state, assign=assign)
    after = _state_bits(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(type(m.weight) is ScaledFp8Tensor for m in model)


def test_a_refused_plain_layout_entry_leaves_a_training_model_unchanged():
    """The same for a ``convert_to_fp8`` model (master weights) loading a plain-layout checkpoint whose last fp8
    entry's scales hold a NaN: nothing loads."""
    torch.manual_seed(0)
    model = fp8tensor.convert_to_fp8(nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32)))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    scale = torch.rand(32, 1) + 0.5
    scale[7] = float("nan")
    state = {"0.weight": torch.randn(48, 64), "0.bias": torch.randn(48),
             "1.weight": torch.randn(32, 48).to(torch.float8_e4m3fn), "1.weight_scale": scale,
             "1.bias": torch.randn(32)}
    with pytest.raises(ValueError, match=r"load_state_dict \('1\.weight' \+ '1\.weight_scale'\)"):
        model.load_state_dict(state)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k].detach()) for k in before)


def test_a_pre_hook_registered_after_conversion_may_bring_the_scales():
    """A model's own ``load_state_dict`` pre-hook, registered after ``quantize_weights``, that renames a checkpoint's
    scale entries (``weight_scale_inv`` -> ``weight_scale``) loads as before: the model's check before the load leaves
    an fp8 entry without its scales to each module's own hook, which runs after it."""
    from fp8tensor.checkpoint import plain_state_dict

    torch.manual_seed(0)
    src = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32)))
    sd = {k.replace("weight_scale", "weight_scale_inv"): v for k, v in plain_state_dict(src.state_dict()).items()}
    model = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32)))

    def rename(mod, state, prefix, *args):
        for k in [k for k in state if k.endswith("_scale_inv")]:
            state[k.replace("_scale_inv", "_scale")] = state.pop(k)

    model.register_load_state_dict_pre_hook(rename)
    model.load_state_dict(sd)
    assert all(same_bits(a.qdata, b.qdata) and torch.equal(a.scale, b.scale)
               for a, b in ((model[i].weight, src[i].weight) for i in range(2)))


def test_a_refused_entry_leaves_activation_checkpointed_blocks_unchanged():
    """Blocks wrapped by ``checkpoint_wrapper`` after ``quantize_weights`` (torchtitan's activation checkpointing):
    their state-dict keys at the root lack the wrapper's segment, and the model's check before the load finds them
    by those keys; a NaN in the last block's entry leaves the first block unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)) for _ in range(2)])
    fp8tensor.quantize_weights(model)
    for i, b in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(b)
    before = _state_bits(model)
    state = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    state["layers.1.1.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"inf or NaN in 1 row\(s\)"):
        model.load_state_dict(state)
    after = _state_bits(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
