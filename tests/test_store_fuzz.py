"""Property-based fuzz of the store's read path (experience_dict.store.faults; 1,000+ cases:
``python scripts/fuzz_store.py``): one file of a small real store damaged (chunk, commit record or array
metadata; deleted, truncated, one bit flipped, or replaced by another valid file of its kind), every read
either returns the committed data or raises a named store error, and verify sees the damage."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experience_dict.store.faults import FAULTS, TARGETS, WINDOWS, build_store, run_case, snapshot


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "base"
    build_store(root)
    return root, snapshot(str(root), WINDOWS)


@settings(max_examples=36, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(TARGETS), fault=st.sampled_from(FAULTS), seed=st.integers(0, 2**31 - 1))
def test_every_read_returns_committed_data_or_names_the_damage(base, tmp_path, target, fault, seed):
    root, truth = base
    res = run_case(root, tmp_path / f"case_{target}_{fault}_{seed}", truth, WINDOWS, target, fault, seed)
    assert res["ok"], (res["fault"], res["failures"])
    reads = res["reads"]
    assert not any(v.get("silent_wrong") or v.get("unnamed") for v in reads.values()), (res["fault"], reads)
