"""``benchmarks/e2e.py`` variant names: suffixes in any order, and nothing misspelled, misplaced or contradictory ever
runs (an fp8 variant silently run as bf16 would put a bf16 time in an fp8 row)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import e2e  # noqa: E402


@pytest.mark.parametrize("variant,base,flags", [
    ("rowwise.sized.fp8ag@fsdp+graph", "rowwise", {".sized", ".fp8ag"}),
    ("rowwise.fp8ag.sized@fsdp", "rowwise", {".sized", ".fp8ag"}),
    ("rowwise_gw_hp.hpag.inductor@tp", "rowwise_gw_hp", {".hpag", ".inductor"}),
    ("bf16@fsdp", "bf16", set()),
    ("ao_tensorwise@fsdp+graph", "ao_tensorwise", set()),
])
def test_suffixes_in_any_order(variant, base, flags):
    precision, setup, _ = e2e.check_variant(variant)
    assert e2e.split_suffixes(precision) == (base, flags)


@pytest.mark.parametrize("variant", [
    "rowwize@fsdp", "bf16.sized@fsdp", "ao_rowwise.hpag@fsdp", "rowwise.hpag.fp8ag@fsdp", "rowwise.sized.sized@fsdp",
    "rowwise.hpag@plain", "rowwise@", "rowwise@fsdp+cuda", "rowwise@nowhere",
])
def test_bad_variants_stop_before_running(variant):
    with pytest.raises(SystemExit, match="e2e.py"):
        e2e.check_variant(variant)
