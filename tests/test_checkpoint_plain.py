"""fp8 weights in the plain checkpoint layout (``weight`` fp8 + ``weight_scale`` float32 ``(N, 1)``): safetensors
and Hugging Face ``save_pretrained``, and back into ``quantize_weights`` models bit for bit.

References: the saved model's own fp8 bytes and scales (bit-exact), its logits on fresh random tokens (equal: the
same fp8 weights run the same kernels). Nothing is downloaded (models are built from a config)."""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import ScaledFp8Tensor, quantize_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _same_fp8(a: ScaledFp8Tensor, b: ScaledFp8Tensor) -> bool:
    return (type(a) is ScaledFp8Tensor and type(b) is ScaledFp8Tensor and a.qdata.dtype == b.qdata.dtype
            and torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8)) and torch.equal(a.scale, b.scale)
            and a.dtype == b.dtype)


def _mlp(dtype=torch.bfloat16):
    return nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 32, bias=False)).to(dtype)


@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_plain_state_dict_layout(f8):
    m = quantize_weights(_mlp(), float8_dtype=f8)
    sd = m.state_dict()
    assert type(sd["0.weight"]) is ScaledFp8Tensor  # default: unchanged
    for plain in (fp8tensor.plain_state_dict(sd), _plain_mode_state_dict(m)):
        assert sorted(plain) == sorted(["0.weight", "0.weight_scale", "0.bias", "2.weight", "2.weight_scale"])
        for i, n in ((0, 64), (2, 32)):
            w, s = plain[f"{i}.weight"], plain[f"{i}.weight_scale"]
            assert type(w) is torch.Tensor and w.dtype == f8 and w.shape == m[i].weight.shape and w.is_contiguous()
            assert type(s) is torch.Tensor and s.dtype == torch.float32 and s.shape == (n, 1)
            assert torch.equal(w.view(torch.uint8), m[i].weight.qdata.view(torch.uint8))
            assert torch.equal(s, m[i].weight.scale)
        assert torch.equal(plain["0.bias"], m[0].bias.detach())
    assert type(m.state_dict()["0.weight"]) is ScaledFp8Tensor  # the block ended


def _plain_mode_state_dict(m):
    with fp8tensor.config(state_dict_fp8="plain"):
        return m.state_dict()


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_safetensors_round_trip(tmp_path, assign):
    st = pytest.importorskip("safetensors.torch")
    src = quantize_weights(_mlp())
    with fp8tensor.config(state_dict_fp8="plain"):
        st.save_model(src, str(tmp_path / "a.safetensors"))
    st.save_file(fp8tensor.plain_state_dict(src.state_dict()), str(tmp_path / "b.safetensors"))
    for name in ("a", "b"):
        dst = quantize_weights(_mlp())
        res = dst.load_state_dict(st.load_file(str(tmp_path / f"{name}.safetensors")), assign=assign)
        assert not res.missing_keys and not res.unexpected_keys
        for i in (0, 2):
            assert _same_fp8(dst[i].weight, src[i].weight), (name, i)
            assert isinstance(dst[i].weight, nn.Parameter) and not dst[i].weight.requires_grad
        x = torch.randn(5, 48, dtype=torch.bfloat16)
        assert torch.equal(dst(x), src(x))
        dst = quantize_weights(_mlp())
        fp8tensor.load_safetensors(dst, tmp_path / f"{name}.safetensors")
        assert _same_fp8(dst[0].weight, src[0].weight) and _same_fp8(dst[2].weight, src[2].weight)


def test_default_safetensors_save_names_the_remedy(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    m = quantize_weights(_mlp())
    for save in (lambda: st.save_file(m.state_dict(), str(tmp_path / "x.safetensors")),
                 lambda: st.save_model(m, str(tmp_path / "y.safetensors"))):
        with pytest.raises(RuntimeError, match=r"fp8tensor: a ScaledFp8Tensor .*state_dict_fp8=\"plain\""):
            save()
    with pytest.raises(RuntimeError, match="fp8tensor: a ScaledFp8Tensor"):
        m[0].weight.storage()


def test_load_errors_are_clear():
    src = quantize_weights(_mlp())
    plain = fp8tensor.plain_state_dict(src.state_dict())
    dst = quantize_weights(_mlp())
    before = dst[0].weight.qdata.clone()
    bad = dict(plain)
    del bad["0.weight_scale"]
    with pytest.raises(ValueError, match=r"'0.weight' is a plain torch.float8_e4m3fn tensor without its scales"):
        dst.load_state_dict(bad)
    bad = dict(plain, **{"0.weight_scale": plain["0.weight_scale"].to(torch.bfloat16)})
    with pytest.raises(TypeError, match="scale must be float32"):
        dst.load_state_dict(bad)
    bad = dict(plain, **{"0.weight_scale": plain["0.weight_scale"][:10]})
    with pytest.raises(ValueError, match="scale"):
        dst.load_state_dict(bad)
    assert torch.equal(dst[0].weight.qdata.view(torch.uint8), before.view(torch.uint8))  # nothing loaded
    with pytest.raises(ValueError, match="state_dict_fp8"):
        fp8tensor.set_config(state_dict_fp8="safetensors")


def test_converted_training_model_saves_high_precision_either_way():
    m = fp8tensor.convert_to_fp8(_mlp(torch.float32))
    for mode in ("subclass", "plain"):
        with fp8tensor.config(state_dict_fp8=mode):
            sd = m.state_dict()
        assert sorted(sd) == ["0.bias", "0.weight", "2.weight"]
        assert type(sd["0.weight"]) is torch.Tensor and sd["0.weight"].dtype == torch.float32


# ------------------------------------------------------------------------------------------------ Hugging Face
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM, cfg


def test_hf_save_pretrained_round_trip(tmp_path):
    cls, cfg = _tiny_llama()
    src = quantize_weights(cls(cfg).to(torch.bfloat16).eval())
    n_fp8 = sum(isinstance(p, ScaledFp8Tensor) for p in src.parameters())
    assert n_fp8 == 2 * 7 + 1  # q k v o gate up down per layer + lm_head
    with pytest.raises(RuntimeError, match="fp8tensor: a ScaledFp8Tensor"):
        src.save_pretrained(tmp_path / "default")
    with fp8tensor.config(state_dict_fp8="plain"):
        src.save_pretrained(tmp_path / "ckpt", max_shard_size="50KB")  # sharded: weight and scale may be apart
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
    assert len(files) > 1, files
    from safetensors import safe_open

    keys = {}
    for f in files:
        with safe_open(str(tmp_path / "ckpt" / f), "pt") as h:
            for k in h.keys():
                keys[k] = h.get_slice(k).get_dtype()
    assert keys["model.layers.1.mlp.up_proj.weight"] == "F8_E4M3"
    assert keys["model.layers.1.mlp.up_proj.weight_scale"] == "F32"
    assert keys["model.embed_tokens.weight"] == "BF16"

    dst = quantize_weights(cls(cfg).to(torch.bfloat16).eval())
    res = fp8tensor.load_safetensors(dst, tmp_path / "ckpt")
    assert not res.missing_keys and not res.unexpected_keys
    src_p, dst_p = dict(src.named_parameters()), dict(dst.named_parameters())
    for k, p in src_p.items():
        if isinstance(p, ScaledFp8Tensor):
            assert _same_fp8(dst_p[k], p), k
        else:
            assert torch.equal(dst_p[k], p), k
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        assert torch.equal(dst(ids).logits, src(ids).logits)


def _fp8_linears(model):
    return sorted(n for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and isinstance(m.weight, ScaledFp8Tensor))


@pytest.mark.parametrize("keep_lm_head", [False, True], ids=["all", "lm_head_hp"])
def test_hf_from_pretrained_of_plain_checkpoint_is_never_silently_wrong(tmp_path, keep_lm_head):
    # from_pretrained of a plain fp8 checkpoint: the config names transformers' fbgemm_fp8 method (the same layout)
    # and exactly the Linears left in high precision, so transformers either loads it with fbgemm's fp8 Linears or
    # raises its own clear error (CPU, or no fbgemm-gpu); it never casts the fp8 values without their scales.
    cls, cfg = _tiny_llama()
    import transformers

    ref = cls(cfg).to(torch.bfloat16).eval()  # built from the same config object: must keep a plain config
    src = cls(cfg).to(torch.bfloat16).eval()
    flt = (lambda m, fqn: fqn != "lm_head") if keep_lm_head else None
    quantize_weights(src, module_filter_fn=flt)
    qc = src.config.quantization_config
    assert isinstance(qc, transformers.FbgemmFp8Config) and qc.quant_method == "fbgemm_fp8"
    assert qc.modules_to_not_convert == (["lm_head"] if keep_lm_head else [])
    assert src.model.config is src.config  # submodules share the new config
    assert getattr(ref.config, "quantization_config", None) is None and getattr(cfg, "quantization_config", None) is None
    # transformers' own matching of modules_to_not_convert selects exactly the fp8 Linears
    from transformers.quantizers.quantizers_utils import should_convert_module

    linears = [n for n, m in src.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(n for n in linears if should_convert_module(n, qc.modules_to_not_convert)) == _fp8_linears(src)
    with fp8tensor.config(state_dict_fp8="plain"):
        src.save_pretrained(tmp_path / "ckpt")
    import json

    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "fbgemm_fp8" and saved["modules_to_not_convert"] == qc.modules_to_not_convert

    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        want = src(ids).logits
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    except (ImportError, ValueError, RuntimeError) as e:  # CPU / no fbgemm-gpu / GPU below sm_90
        assert re.search(r"fbgemm|GPU|CUDA|compute capability", str(e)), str(e)
    else:  # fbgemm-gpu on a GPU: its own fp8 kernels (dynamic activation scale bound): fp8-level agreement
        loaded = loaded.to(want.device)
        with torch.no_grad():
            got = loaded(ids.to(want.device)).logits.double()
        assert (got - want.double()).abs().max() <= 0.1 * want.double().abs().max() + 1e-2

    # fp8tensor's own load path, from the saved config (which carries the quantization_config): from_config does not
    # quantize, quantize_weights does, load_safetensors loads bit for bit
    config = transformers.AutoConfig.from_pretrained(tmp_path / "ckpt")
    dst = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    assert type(dst.model.layers[0].mlp.up_proj) is torch.nn.Linear
    quantize_weights(dst, module_filter_fn=flt)
    res = fp8tensor.load_safetensors(dst, tmp_path / "ckpt")
    assert not res.missing_keys and not res.unexpected_keys
    ids = torch.randint(0, 128, (3, 7))
    with torch.no_grad():
        assert torch.equal(dst(ids).logits, src(ids).logits)
    # load_state_dict (subclass form) into a quantize_weights model with the config present
    dst2 = quantize_weights(cls(config).to(torch.bfloat16).eval(), module_filter_fn=flt)
    dst2.load_state_dict(src.state_dict())
    with torch.no_grad():
        assert torch.equal(dst2(ids).logits, src(ids).logits)


def test_hf_non_fbgemm_fp8_refuses_plain_save(tmp_path):
    # e5m2 weights: no fbgemm_fp8 checkpoint holds them, so save_pretrained in the plain layout refuses (naming the
    # remedy) instead of writing a checkpoint from_pretrained would read without scales; the remedy works.
    st = pytest.importorskip("safetensors.torch")
    cls, cfg = _tiny_llama()
    src = quantize_weights(cls(cfg).to(torch.bfloat16).eval(), float8_dtype=torch.float8_e5m2)
    assert getattr(src.config, "quantization_config", None) is None
    with fp8tensor.config(state_dict_fp8="plain"):
        with pytest.raises(ValueError, match=r"fp8tensor state_dict.*fbgemm_fp8.*fp8tensor\.plain_state_dict"):
            src.save_pretrained(tmp_path / "ckpt")
    st.save_file(fp8tensor.plain_state_dict(src.state_dict()), str(tmp_path / "m.safetensors"))
    dst = quantize_weights(cls(cfg).to(torch.bfloat16).eval(), float8_dtype=torch.float8_e5m2)
    fp8tensor.load_safetensors(dst, tmp_path / "m.safetensors")
    ids = torch.randint(0, 128, (2, 5))
    with torch.no_grad():
        assert torch.equal(dst(ids).logits, src(ids).logits)


def test_non_hf_model_gets_no_config():
    m = quantize_weights(_mlp())
    assert not hasattr(m, "config")


def test_hf_fp8_linear_kept_in_fp32_by_transformers_refuses_plain_save(tmp_path):
    # transformers never converts a model's _keep_in_fp32_modules: an fp8 Linear among them cannot be described
    cls, cfg = _tiny_llama()
    src = cls(cfg).to(torch.bfloat16).eval()
    src._keep_in_fp32_modules = ["down_proj"]
    quantize_weights(src)
    assert getattr(src.config, "quantization_config", None) is None
    with fp8tensor.config(state_dict_fp8="plain"), pytest.raises(ValueError, match="keeps in float32"):
        src.save_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_checkpoint_into_training_model_dequantizes(dtype):
    """A plain fp8 checkpoint loaded into a ``convert_to_fp8`` model (fine-tuning from fp8 weights): each master gets
    ``q * scale`` in its dtype, never the raw fp8 values; without its scale the load refuses and changes nothing."""
    torch.manual_seed(0)
    sd = fp8tensor.plain_state_dict(quantize_weights(_mlp(dtype)).state_dict())
    model = fp8tensor.convert_to_fp8(_mlp(dtype))
    model.load_state_dict(sd)
    for i in (0, 2):
        want = (sd[f"{i}.weight"].float() * sd[f"{i}.weight_scale"]).to(dtype)
        assert torch.equal(model[i].weight._data, want)
    assert torch.equal(model[0].bias, sd["0.bias"])
    before = [model[i].weight._data.clone() for i in (0, 2)]
    bad = {k: v for k, v in sd.items() if k != "2.weight_scale"}
    with pytest.raises(ValueError, match=r"'2\.weight' is a plain torch.float8_e4m3fn tensor without its scales"):
        model.load_state_dict(bad)
    assert all(torch.equal(model[i].weight._data, b) for i, b in zip((0, 2), before))


def test_assign_of_high_precision_weights_stores_fp8_again():
    """``load_state_dict(hp_state, assign=True)`` into a ``quantize_weights`` model: the weights are stored in fp8
    again (row-wise, as ``quantize_weights`` does; same bits as quantizing the loaded values)."""
    torch.manual_seed(0)
    m = quantize_weights(_mlp(torch.float32))
    hp = _mlp(torch.float32)
    m.load_state_dict(hp.state_dict(), assign=True)
    for i in (0, 2):
        w = m[i].weight
        assert type(w) is ScaledFp8Tensor and not w.requires_grad
        assert _same_fp8(w.detach(), ScaledFp8Tensor.from_hp(hp[i].weight.detach(), torch.float8_e4m3fn))
    x = torch.randn(5, 48)
    ref = hp.double()(x.double())
    # two GEMMs in series, each with both operands rounded to e4m3 (≈3.6% each on Gaussian data): ≈5% together
    assert ((m(x).double() - ref).norm() / ref.norm()).item() < 1e-1


def test_assign_of_meta_or_fake_weights_ties_nothing():
    """Meta (and fake) tensors have no memory of their own (every data pointer 0): ``load_state_dict(assign=True)``
    of such a state dict loads without tying same-shaped weights or comparing their (absent) data."""
    m = quantize_weights(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    meta = {k: torch.empty_like(v.to_hp() if isinstance(v, ScaledFp8Tensor) else v, device="meta")
            for k, v in m.state_dict().items()}
    m.load_state_dict(meta, assign=True)
    assert m[0].weight is not m[1].weight and m[0].weight.device.type == "meta"


def test_a_record_left_by_a_submodule_load_ties_nothing_at_the_next_model_load():
    """A load into one submodule leaves its record of where its weight came from (no model-level re-tie runs); the
    model's next load drops such records first, so a module that load does not touch (``strict=False``) is not tied
    to another loaded from the same tensor."""
    m = quantize_weights(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    v = torch.randn(16, 16)
    m[1].load_state_dict({"weight": v, "bias": torch.zeros(16)}, assign=True)
    assert hasattr(m[1], "_fp8_loaded_from")
    m.load_state_dict({"0.weight": v, "0.bias": torch.zeros(16)}, strict=False, assign=True)
    assert m[0].weight is not m[1].weight
    assert not any(hasattr(mod, "_fp8_loaded_from") for mod in m.modules())


@pytest.mark.parametrize("where", ["root", "submodule_first"])
def test_assign_of_a_tied_weight_keeps_the_tie(where):
    """Two Linears sharing one weight, ``quantize_weights``, then ``load_state_dict(assign=True)`` of a state dict
    holding one tensor under both keys: the two Linears hold one fp8 Parameter again (as ``nn.Linear``s would hold
    one memory), so a later write through one is seen by the other. Weights loaded from different tensors stay
    apart, also when their values are equal; a load of a submodule alone (no re-tie there) leaves no record that
    ties anything at the model's next load."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    m[1].weight = m[0].weight
    quantize_weights(m)
    assert m[0].weight is m[1].weight
    if where == "submodule_first":
        v = torch.randn(16, 16)
        m[2].load_state_dict({"weight": v, "bias": torch.zeros(16)}, assign=True)
    w, w_equal = torch.randn(16, 16), torch.randn(16, 16)
    m.load_state_dict({"0.weight": w, "0.bias": torch.zeros(16), "1.weight": w, "1.bias": torch.zeros(16),
                       "2.weight": w_equal, "2.bias": torch.zeros(16)}, assign=True)
    assert m[0].weight is m[1].weight and m[2].weight is not m[0].weight
    assert _same_fp8(m[0].weight.detach(), ScaledFp8Tensor.from_hp(w))
    with torch.no_grad():
        m[0].weight.copy_(torch.randn(16, 16) * 5)
    assert torch.equal(fp8tensor.dequantize(m[1].weight), fp8tensor.dequantize(m[0].weight))
    # equal values, separate tensors: separate Parameters
    m2 = quantize_weights(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    m2.load_state_dict({"0.weight": w, "0.bias": torch.zeros(16), "1.weight": w.clone(), "1.bias": torch.zeros(16)},
                       assign=True)
    assert m2[0].weight is not m2[1].weight
    assert not any(hasattr(mod, "_fp8_loaded_from") for mod in (*m.modules(), *m2.modules()))


def test_assign_of_an_fp8_checkpoint_into_a_training_model_trains():
    """A ``quantize_weights`` checkpoint (``ScaledFp8Tensor`` weights) loaded with ``assign=True`` into a
    ``convert_to_fp8`` model: each weight becomes a trainable master holding the checkpoint's dequantized values
    (as the load without ``assign`` gives), and an optimizer step updates it (it left an fp8 Parameter requiring
    grad, which failed at the step). A model stored in fp8 itself keeps the fp8 weights."""
    torch.manual_seed(0)
    base = _mlp(torch.float32)
    ckpt = quantize_weights(copy_module(base)).state_dict()
    m = fp8tensor.convert_to_fp8(copy_module(base))
    m.load_state_dict(ckpt, assign=True)
    for i in (0, 2):
        w = m[i].weight
        assert type(w) is fp8tensor.Fp8MasterWeight and w.requires_grad and w.dtype == torch.float32
        assert torch.equal(w._data, ckpt[f"{i}.weight"].to_hp())
    before = m[0].weight._data.clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(5, 48)).sum().backward()
    opt.step()
    assert not torch.equal(m[0].weight._data, before)
    served = quantize_weights(fp8tensor.convert_to_fp8(copy_module(base)))
    served.load_state_dict(ckpt, assign=True)
    assert all(type(served[i].weight) is ScaledFp8Tensor for i in (0, 2))


def copy_module(m):
    import copy

    return copy.deepcopy(m)


def test_names_that_earlier_pickles_refer_to_still_resolve():
    """Whole-model pickles and ``weights_only`` state dicts of earlier versions name flat module paths
    (``fp8tensor.convert._refuse_tp_export``, ``fp8tensor.tensor._rebuild_scaled_fp8``): they still resolve."""
    import importlib

    for path in ("fp8tensor.convert._new_converted", "fp8tensor.convert._new_converted_experts",
                 "fp8tensor.convert._refuse_tp_export", "fp8tensor.convert._plain_state_dict_hook",
                 "fp8tensor.convert._rewrap_after_load", "fp8tensor.convert._requantize_after_load",
                 "fp8tensor.tensor._rebuild_scaled_fp8", "fp8tensor.master.Fp8MasterWeight"):
        mod, name = path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(mod), name)), path
    safe = {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}"
            for g in torch.serialization.get_safe_globals()}
    assert {"fp8tensor.tensor._rebuild_scaled_fp8", "fp8tensor.tensor.ScaledFp8Tensor"} <= safe
    # a pickle that names the flat path of the rebuild function loads with weights_only=True
    import io

    w = fp8tensor.ScaledFp8Tensor.from_hp(torch.randn(8, 16))
    buf = io.BytesIO()
    torch.save({"w": w}, buf, _use_new_zipfile_serialization=False)  # (one pickle stream: names are plain text)
    raw = buf.getvalue().replace(b"fp8tensor.subclass.tensor", b"fp8tensor.tensor")
    assert raw != buf.getvalue()
    got = torch.load(io.BytesIO(raw), weights_only=True)["w"]
    assert torch.equal(got.qdata.view(torch.uint8), w.qdata.view(torch.uint8)) and torch.equal(got.scale, w.scale)
