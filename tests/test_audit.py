"""Retrieval audit: concentration metrics on hand-made counts, and the files of a real FERT round."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experience_dict.store import ExperienceStore
from fleet.fert.audit import (
    _hindsight,
    concentration,
    round_outcomes,
    wilson_interval,
    write_retrieval_audit,
)
from fleet.fert.data import FertData
from fleet.fert.keys import STATE_KEYS
from tests.test_retrieval import FERT_CFG, HELDOUT, build_store


def test_concentration_hand_computed():
    c = concentration([2, 2], n_candidates=4)
    assert c["entropy"] == pytest.approx(math.log(2)) and c["effective_number"] == pytest.approx(2.0)
    assert c["top1_share"] == 0.5 and c["coverage"] == 0.5
    assert c["gini"] == pytest.approx(0.5)                 # sorted [0, 0, 2, 2]: 2*14/(4*4) - 5/4
    one = concentration([5], n_candidates=1)
    assert one["effective_number"] == pytest.approx(1.0) and one["top1_share"] == 1.0 and one["gini"] == 0.0
    even = concentration([3, 3, 3])
    assert even["gini"] == pytest.approx(0.0) and even["effective_number"] == pytest.approx(3.0)
    skew = concentration([97, 1, 1, 1])
    assert skew["top1_share"] == 0.97 and 1.0 < skew["effective_number"] < 1.3 and skew["gini"] > 0.7
    assert concentration([])["selections"] == 0.0
    with pytest.raises(ValueError, match="n_candidates"):
        concentration([1, 1, 1], n_candidates=2)
    with pytest.raises(ValueError, match="non-negative"):
        concentration([1, -1])
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)


def test_audit_files_of_a_round(tmp_path):
    url = str(tmp_path / "store")
    _, ids = build_store(url)
    reader = ExperienceStore.open(url)
    fert = FertData(reader, FERT_CFG, stats=reader.stats(list(STATE_KEYS)), exclude_units=[HELDOUT])
    fert.update()
    ret = fert.retrieve()
    outcomes = round_outcomes(reader, min_version=1, exclude_units=[HELDOUT])
    audit = write_retrieval_audit(ret, fert.index, tmp_path / "audits", round_idx=3, outcomes=outcomes)
    js = tmp_path / "audits" / "retrieval_audit_round_003.json"
    png = tmp_path / "audits" / "retrieval_audit_round_003.png"
    assert js.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    on_disk = json.loads(js.read_text())
    assert on_disk["round"] == 3 and on_disk["selections"] == len(ret) == audit["selections"]
    # every failure context and what it retrieved, for the stage analysis (fleet/stages.py)
    got = on_disk["retrieved"]
    assert len(got["entries"]) == len(ret) and len(got["contexts"]) == len(ret.contexts)
    assert all(reader.episode(e["episode_id"]).success and 0 <= e["context"] < len(got["contexts"])
               for e in got["entries"])
    # outcomes: the stalled failures of version 1 (4 per task, +1 near-duplicate in push; the flat one is v0)
    assert outcomes["push-v3"]["episodes"] == 5 and outcomes["push-v3"]["successes"] == 0
    assert on_disk["outcomes"]["reach-v3"]["rate"] == 0.0
    total = 0
    for task, entry in on_disk["per_task"].items():
        conc, h = entry["concentration"], entry["hindsight"]
        total += conc["selections"]
        assert sum(entry["per_unit"].values()) == conc["selections"] == h["selections"]
        assert str(HELDOUT) not in entry["per_unit"]
        assert 1.0 <= conc["effective_number"] <= conc["sources"] <= h["candidates"]
        assert 0.0 < conc["top1_share"] <= 1.0 and 0.0 <= conc["gini"] < 1.0 and 0 < conc["coverage"] <= 1.0
        assert entry["top_sources"][0]["selections"] == max(s["selections"] for s in entry["top_sources"])
        # the rule's per-context best >= the best single experience >= a random experience / window
        assert h["rule_top1"] >= h["best_single_any"]["score"] - 1e-6
        assert h["best_single_any"]["score"] >= h["best_single_selected"]["score"] - 1e-6
        assert h["best_single_any"]["score"] >= h["random_single"] - 1e-6
        assert h["random_single"] >= h["random_window"] - 1e-6
        # every stalled failure has an exact match (push also has the flat failure, whose context has none)
        assert h["rule_top1"] > (0.99 if task == "reach-v3" else 0.8)
        assert reader.episode(h["best_single_selected"]["episode_id"]).success
    assert total == len(ret)
    assert on_disk["overall"]["per_task"] == {t: on_disk["per_task"][t]["concentration"]["selections"]
                                              for t in on_disk["per_task"]}
    # the selection is concentrated where it should be: each failure's own family success is its top source
    push = on_disk["per_task"]["push-v3"]
    top_ids = {s["episode_id"] for s in push["top_sources"]}
    assert {ids["family_success"][e] for e in ids["family_success"]
            if ids["failure"][e] == "push-v3"} <= top_ids | {push["hindsight"]["best_single_any"]["episode_id"]}
    assert np.isfinite(push["hindsight"]["rule_topk_weighted"])
    # the hindsight pass reads the index in chunks: a chunk size splitting episodes gives the same numbers
    ctx = np.array([i for i, c in enumerate(ret.contexts) if c.task == "push-v3"])
    small = _hindsight(ret, fert.index, "push-v3", ctx, {e for e in ret.episode_id}, chunk=7)
    for key in ("rule_top1", "random_single", "random_window"):
        assert small[key] == pytest.approx(push["hindsight"][key], abs=1e-5)
    assert small["best_single_any"] == pytest.approx(push["hindsight"]["best_single_any"])
