"""One optimizer over all parameters of a converted model (masters and plain tensors in one list) allocates what the
same optimizer allocates for the unconverted model, and what one optimizer per kind of parameter allocates: no copy
of a master, in the first step (state creation) or later. Updates, state and ``state_dict`` are bit-identical.

Bytes are the CPU allocator's own records (``_optim_steps.allocations``), so an allocation made inside the master's
``__torch_dispatch__`` (below autograd) counts. Bound: a copy of any master would add at least the bytes of the
smallest master (``SLACK`` is a quarter of them); the allowance covers the 0-dim scalars an optimizer makes per call
(a second optimizer makes a second set).
FSDP2 and tensor parallelism (DTensor parameters whose local tensor is a master): ``distributed/test_optimizer_memory_gloo.py``.
"""
from __future__ import annotations

import copy

import pytest
import torch

from fp8tensor import convert_to_fp8

from _optim_steps import OPTIMIZERS, allocations, is_master, make_model, make_optimizers, plain_value, run_steps

STEPS = 3


def _setups():
    """The unconverted model and two converted copies with the same values."""
    plain = make_model()
    one, per_kind = copy.deepcopy(plain), copy.deepcopy(plain)
    convert_to_fp8(one)
    convert_to_fp8(per_kind)
    return plain, one, per_kind


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_optimizer_over_masters_and_plain_parameters_allocates_no_copy(name):
    """Per step (the first creates the state): a converted model's optimizer allocates what the unconverted model's
    allocates, with one optimizer over all parameters and with one per kind (the unconverted model split the same
    way); one optimizer allocates as many bytes as the per-kind pair. Fused: the same peak too. Foreach and for-loop
    steps make temporaries (over the whole list, or per parameter in list order), so how a list is split moves their
    peak by PyTorch's own design, converted or not: there the peak is checked against the unconverted model split
    the same way."""
    plain, one, per_kind = _setups()
    plain_split = copy.deepcopy(plain)
    kinds = [is_master(p) for p in one.parameters()]
    masters = [p for p in one.parameters() if is_master(p)]
    assert sum(kinds) == 3 and len(kinds) > 3
    slack = min(m.numel() * m.element_size() for m in masters) // 4
    grads = [[torch.randn_like(plain_value(p)) for p in plain.parameters()] for _ in range(STEPS)]

    models = {"plain": plain, "plain_split": plain_split, "one": one, "per_kind": per_kind}
    opts = {
        "plain": make_optimizers(plain.parameters(), name),
        "plain_split": make_optimizers(plain_split.parameters(), name, kinds),
        "one": make_optimizers(one.parameters(), name),
        "per_kind": make_optimizers(per_kind.parameters(), name, kinds),
    }
    assert len(opts["per_kind"]) == 2 and len(opts["one"]) == 1
    used = {k: run_steps(models[k].parameters(), opts[k], grads) for k in models}

    def close(a, b):
        return abs(a - b) <= slack

    for step in range(STEPS):
        u = {k: used[k][step] for k in used}
        for conv, ref in (("one", "plain"), ("per_kind", "plain_split")):
            assert close(u[conv][0], u[ref][0]) and close(u[conv][1], u[ref][1]), (step, conv, used)
        assert close(u["one"][0], u["per_kind"][0]), (step, used)
        if "fused" in name:
            assert close(u["one"][1], u["per_kind"][1]), (step, used)
    if name == "adamw_foreach":
        # the meter sees a step's full-size temporaries: foreach AdamW builds sqrt(exp_avg_sq) for all parameters
        total = sum(p.numel() * p.element_size() for p in plain.parameters())
        assert all(a >= total for k in used for a, _ in used[k]), used

    # updates bit-identical to the unconverted model, with one optimizer and per kind
    for k in ("one", "per_kind", "plain_split"):
        for p_ref, p in zip(plain.parameters(), models[k].parameters()):
            assert torch.equal(plain_value(p), p_ref.detach()), k


@pytest.mark.parametrize("name", ["adamw_fused", "sgd_momentum_foreach"])
def test_one_optimizer_state_dict_matches_unconverted_model(name):
    plain, one, per_kind = _setups()
    grads = [[torch.randn_like(plain_value(p)) for p in plain.parameters()] for _ in range(2)]
    o_plain, o_one = make_optimizers(plain.parameters(), name), make_optimizers(one.parameters(), name)
    run_steps(plain.parameters(), o_plain, grads)
    run_steps(one.parameters(), o_one, grads)
    sd_plain, sd_one = o_plain[0].state_dict(), o_one[0].state_dict()
    assert sd_one["param_groups"] == sd_plain["param_groups"]
    assert sd_one["state"].keys() == sd_plain["state"].keys() and len(sd_one["state"]) == len(list(one.parameters()))
    for i, st in sd_one["state"].items():
        assert st.keys() == sd_plain["state"][i].keys()
        for key, v in st.items():
            assert type(v) is torch.Tensor, (i, key, type(v))  # optimizer state is plain: checkpoints need no fp8tensor
            assert torch.equal(v, sd_plain["state"][i][key]), (i, key)
    # loading it into a fresh optimizer over the converted model gives the same next step as the unconverted one
    one2 = copy.deepcopy(one)
    o_one2 = make_optimizers(one2.parameters(), name)
    o_one2[0].load_state_dict(sd_one)
    g = [[torch.randn_like(plain_value(p)) for p in plain.parameters()]]
    run_steps(plain.parameters(), o_plain, g)
    run_steps(one2.parameters(), o_one2, g)
    for p_ref, p in zip(plain.parameters(), one2.parameters()):
        assert torch.equal(plain_value(p), p_ref.detach())


def test_allocation_meter_counts_bytes_allocated_inside_a_master_dispatch():
    """The meter must see a copy made below ``__torch_dispatch__`` (where a dispatch mode would not look)."""
    plain, one, _ = _setups()
    masters = [p for p in one.parameters() if is_master(p)]
    nbytes = sum(m.numel() * m.element_size() for m in masters)
    with torch.no_grad():
        allocated, peak = allocations(lambda: [m.mul(1.0) for m in masters])  # runs on _data, returns plain results
    assert allocated >= nbytes and nbytes <= peak <= allocated
    allocated, peak = allocations(lambda: [m.detach() for m in masters])  # views: no data
    assert peak < min(m.numel() * m.element_size() for m in masters)
