"""fp8tensor inside torchtitan 0.3.0: the real package's Llama3 debug model (6 blocks, dim 256, vocab 2048),
its TP sharding with sequence parallelism and its FSDP2 (bf16 mixed precision), on 4 gloo processes (FSDP 2 x TP 2),
for the DTensor SPMD backends ``partial_dtensor`` and ``full_dtensor``, trained 3 AdamW steps from the same
weights on the same tokens in every conversion order (see ``_titan_worker.py``):
``converter`` (fp8tensor.torchtitan's model converter, before the model is built), ``after_tp`` (convert_to_fp8
between torchtitan's TP and its FSDP2), ``after_both`` (after parallelize_llama) and ``after_init`` (after
weight initialization), against ``hp`` (no conversion).

Checked per order, on every rank:

* the 30 block Linears are converted (``lm_head`` is filtered out), with no fp8tensor warning;
* exactly 3 fp8 GEMMs (``torch._scaled_mm``) per converted Linear per step: 90;
* the loss tracks high precision: relative difference <= 5e-3 at every step (measured <= 1e-4: the fp8 rounding of
  each GEMM, 2^-4 relative per element, averages out over 256- to 768-long contractions and the 2048-way softmax;
  a Linear left in bf16 would show as 0 fp8 GEMMs, a wrong scale as an O(1) loss difference);
* all conversion orders give the same losses (identical weights and fp8 numerics; measured bit-identical).

torchtitan is a test dependency installed by ``.ci/run`` (``--no-deps`` plus the few packages the llama3 path
imports, see docs/torchtitan.md); with ``FP8TENSOR_REQUIRE_TORCHTITAN=1`` (set by .ci/run) a missing torchtitan
is an error, not a skip.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

if os.environ.get("FP8TENSOR_REQUIRE_TORCHTITAN") == "1":
    import torchtitan  # noqa: F401  (CI: must be installed)
else:
    pytest.importorskip("torchtitan", reason="torchtitan not installed (see docs/torchtitan.md)")

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ORDERS = ("hp", "converter", "after_tp", "after_both", "after_init")
FP8_ORDERS = ORDERS[1:]
STEPS = 3
N_CONVERTED = 6 * 5  # wqkv, wo, w1, w2, w3 per block
WORLD, TP = 4, 2
LOSS_VS_HP = 5e-3
#: losses of the fp8 orders among themselves: identical weights, placements and fp8 numerics (measured identical);
#: margin for a float32 summation-order difference flipping a single fp8 rounding
SAME_NUMERICS = 1e-4


@pytest.fixture(scope="module", params=["partial_dtensor", "full_dtensor"])
def results(request, tmp_path_factory):
    sys.path.insert(0, str(HERE))
    from _spawn import spawn

    out = tmp_path_factory.mktemp(f"titan_{request.param}")
    return spawn("_titan_worker", "train", WORLD, out, extra=(ORDERS, TP, request.param, STEPS), timeout=900)


@pytest.mark.parametrize("order", FP8_ORDERS)
def test_every_block_linear_is_converted_without_warning(results, order):
    for r in results:
        conv = r[order]["converted"]
        assert len(conv) == N_CONVERTED and not any("lm_head" in f for f in conv), conv
        assert r[order]["warnings"] == []


@pytest.mark.parametrize("order", FP8_ORDERS)
def test_three_fp8_gemms_per_converted_linear_per_step(results, order):
    for r in results:
        assert r[order]["gemms"] == [3 * N_CONVERTED] * STEPS
    assert all(r["hp"]["gemms"] == [0] * STEPS for r in results)


@pytest.mark.parametrize("order", FP8_ORDERS)
def test_loss_tracks_high_precision(results, order):
    hp, fp8 = results[0]["hp"]["losses"], results[0][order]["losses"]
    for a, b in zip(fp8, hp):
        assert abs(a - b) / b <= LOSS_VS_HP, (fp8, hp)


def test_conversion_orders_agree(results):
    ref = results[0]["converter"]["losses"]
    for order in FP8_ORDERS:
        for a, b in zip(results[0][order]["losses"], ref):
            assert abs(a - b) / b <= SAME_NUMERICS, (order, results[0][order]["losses"], ref)


@pytest.mark.parametrize("root", ["model_config", "model_spec"])
@pytest.mark.parametrize("target", ["fp8tensor_linear", "fp8tensor_linear_layers"])
def test_cli_override_converts_linears(root, target):
    """``--override.imports 'fp8tensor.torchtitan.<target>={"recipe": ...}'`` through torchtitan's own override
    parser and applier, on the model config and on its ModelSpec (the trainer reaches the model through it):
    ``fp8tensor_linear`` converts all 31 Linears, ``fp8tensor_linear_layers`` the 30 block Linears, not lm_head;
    the option reaches every converted module; the model builds and passes torchtitan's module protocol check."""
    import torch
    from torchtitan.config.override import OverrideConfig, apply_overrides, parse_cli_imports
    from torchtitan.models.llama3 import model_registry

    from fp8tensor import Fp8MasterWeight
    from fp8tensor.torchtitan import Fp8TensorLinear

    spec = model_registry("debugmodel")
    imports = parse_cli_imports([f'fp8tensor.torchtitan.{target}={{"recipe": "rowwise_gw_hp"}}'])
    apply_overrides(OverrideConfig(imports=imports), spec if root == "model_spec" else spec.model)
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    conv = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Fp8TensorLinear)}
    assert len(conv) == (N_CONVERTED + 1 if target == "fp8tensor_linear" else N_CONVERTED)
    assert ("lm_head" in conv) == (target == "fp8tensor_linear")
    assert all(m.fp8_recipe.name == "rowwise_gw_hp" and isinstance(m.weight, Fp8MasterWeight) for m in conv.values())


def test_converter_options():
    """Fp8TensorConverter: ``filter_fqns`` keeps matching Linears, an unknown recipe raises ValueError naming the
    known ones when the converter is built (as torchtitan's model_registry builds it)."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3 import model_registry

    from fp8tensor.torchtitan import Fp8TensorConverter, Fp8TensorLinear

    spec = model_registry("debugmodel", converters=[Fp8TensorConverter.Config(filter_fqns=["wo", "lm_head"])])
    kinds = {fqn: type(c) for fqn, c, _, _ in spec.model.traverse(Linear.Config)}
    assert sum(k is Fp8TensorLinear.Config for k in kinds.values()) == 6 * 4
    assert all(k is not Fp8TensorLinear.Config for f, k in kinds.items() if f.endswith("wo") or f == "lm_head")
    with pytest.raises(ValueError, match="unknown recipe 'tensorwise'"):
        model_registry("debugmodel", converters=[Fp8TensorConverter.Config(recipe="tensorwise")])
    with pytest.raises(ValueError, match=r"multiples of 16.*24 -> 32"):
        Fp8TensorLinear.Config(in_features=24, out_features=32).build()


def test_converter_size_rule():
    """Fp8TensorConverter(size_rule=True): each Linear's recipe from fp8tensor's size-aware choice (thresholds set
    low for the debug model's dim 256: K·N/(K+N) 128 (256 -> 256) stays high precision below 150, the 256 <-> 768
    MLP (192) gets rowwise_gw_hp below 200; nothing is rowwise)."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3 import model_registry

    import fp8tensor
    from fp8tensor.torchtitan import Fp8TensorConverter, Fp8TensorLinear

    with fp8tensor.config(size_rule_min=150, size_rule_fp8_grad_weight_min=200):
        spec = model_registry("debugmodel", converters=[Fp8TensorConverter.Config(size_rule=True,
                                                                                  filter_fqns=["lm_head"])])
    nodes = {fqn: c for fqn, c, _, _ in spec.model.traverse(Linear.Config)}
    fp8 = {f: c for f, c in nodes.items() if type(c) is Fp8TensorLinear.Config}
    for f, c in nodes.items():
        k_n = c.in_features * c.out_features / (c.in_features + c.out_features)
        if f == "lm_head" or k_n < 150:
            assert f not in fp8, f
        else:
            assert fp8[f].recipe == "rowwise_gw_hp", (f, k_n)
    assert fp8, sorted(nodes)
    model = spec.model.build()  # the built Linears keep the recipe chosen in the config (global size rule off)
    built = {f: m.fp8_recipe.name for f, m in model.named_modules() if isinstance(m, Fp8TensorLinear)}
    assert built and set(built.values()) == {"rowwise_gw_hp"}


def test_llama3_debugmodel_fp8tensor_config():
    """``--module fp8tensor.torchtitan --config llama3_debugmodel_fp8tensor``: torchtitan's debug trainer config with
    the converter (needs torchtitan's full dependencies: its trainer imports the dataset and tensorboard stack,
    which CI does not install)."""
    pytest.importorskip("torchtitan.trainer", reason="torchtitan's trainer dependencies are not installed")
    from torchtitan.models.common.linear import Linear

    from fp8tensor.torchtitan import Fp8TensorLinear, llama3_debugmodel_fp8tensor

    cfg = llama3_debugmodel_fp8tensor().model_spec.model
    kinds = [type(c) for _, c, _, _ in cfg.traverse(Linear.Config)]
    assert kinds.count(Fp8TensorLinear.Config) == N_CONVERTED
