"""The README's Serving snippet runs as written on a Hugging Face Llama (the device from the environment; a tiny random
Llama saved to ``path``), and its promises hold: the exported program's logits equal eager fp8's bit for
bit, the AOTInductor package's agree with them within the measured few percent and with the float64 model within the
fp8 bound, and the checkpoint loads back bit for bit into a model built in the saved dtype."""
from __future__ import annotations

import os
import pathlib
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Serving\n"):text.index("## Tests\n")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _tiny_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(path)
    return m


def test_readme_serving_snippet_runs_as_written(tmp_path, monkeypatch):
    if not hasattr(torch._inductor, "aoti_compile_and_package"):
        pytest.skip("this torch has no AOTInductor packaging")
    path = str(tmp_path / "hf")
    _tiny_llama(path)
    code = _snippet()
    assert '"cuda"' not in code.replace('"cuda" if torch.cuda.is_available()', "")  # the device is never hard-coded
    monkeypatch.chdir(tmp_path)
    ns = {"path": path}
    exec(compile(code, "README.md (Serving)", "exec"), ns)  # noqa: S102

    model, ids, ep, logits, served = ns["model"], ns["ids"], ns["ep"], ns["logits"], ns["served"]
    assert os.path.isfile("model_ep.pt2") and os.path.isfile("model.pt2")
    with torch.no_grad():
        eager = model(ids).logits
        ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float64).eval()(ids).logits
        assert torch.equal(ep.module()(ids).logits, eager)
        rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
        assert rel(logits, eager) < 0.1  # the decomposed / compiled program re-rounds activations (docs/serving.md)
        assert rel(logits, ref) < 0.1 and rel(eager, ref) < 0.1
        assert torch.equal(served(ids).logits, eager)  # the checkpoint loaded back bit for bit


def test_load_safetensors_warns_on_another_dtype(tmp_path):
    import warnings

    import fp8tensor
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    path = str(tmp_path / "hf")
    m = fp8tensor.quantize_weights(_tiny_llama(str(tmp_path / "src")))
    with fp8tensor.config(state_dict_fp8="plain"):
        m.save_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    with pytest.warns(UserWarning, match="checkpoint tensors are torch.bfloat16 where the model's are torch.float32"):
        fp8tensor.load_safetensors(fp8tensor.quantize_weights(LlamaForCausalLM(cfg)), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        served = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        fp8tensor.load_safetensors(fp8tensor.quantize_weights(served), path)
