"""fp8 weights in the plain checkpoint layout (``weight`` fp8 + ``weight_scale`` float32 ``(N, 1)``): safetensors
and Hugging Face ``save_pretrained``, and back into ``quantize_weights`` models bit for bit.

References: the saved model's own fp8 bytes and scales (bit-exact), its logits on fresh random tokens (equal: the
same fp8 weights run the same kernels). Nothing is downloaded (models are built from a config)."""
from __future__ import annotations

import os

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
