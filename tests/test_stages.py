"""Per-stage progress of multi-stage tasks (fleet.stages) on real Meta-World episodes and a real store."""

from __future__ import annotations

import numpy as np
import pytest

import sim
from fleet.stages import (
    STAGE_NAMES,
    STAGED_TASKS,
    episode_stage,
    retrieval_stage_match,
    stage_at,
    stall_table,
    write_stall_report,
)

KEYS = ["progress.near_object", "progress.grasp_success", "progress.in_place_reward"]


def _expert_episode(task: str, seed: int, steps: int | None = None):
    """One scripted-expert episode of ``task``: (progress {key: (T,)}, success, first step each stage's signal
    crossed its threshold)."""
    env = sim.make_env(task, 0)
    obs, _ = env.reset(seed=seed)
    expert = sim.make_expert(env, noise_std=0.0, seed=seed)
    prog = {k: [] for k in KEYS}
    ok = False
    for _ in range(steps or 300):
        obs, _, term, trunc, info = env.step(expert(obs))
        for k in KEYS:
            prog[k].append(info["progress"][k[len("progress."):]])
        ok |= bool(info["success"])
        if term or trunc:
            break
    env.close()
    return {k: np.asarray(v, np.float32) for k, v in prog.items()}, ok


@pytest.mark.parametrize("task", ["pick-place-wall-v3", "stick-pull-v3"])
def test_the_expert_crosses_every_stage_in_order(task):
    prog, ok = _expert_episode(task, seed=3)
    assert ok and episode_stage(task, prog, ok) == len(STAGE_NAMES) - 1
    firsts = [int(np.flatnonzero(prog[k] >= 0.5)[0]) for k in KEYS]
    assert firsts == sorted(firsts), f"{task}: stages crossed out of order at steps {firsts}"
    # cut before each crossing, the episode stalls at the stage before it
    for k, t in enumerate(firsts):
        cut = {key: v[:t] for key, v in prog.items()}
        assert episode_stage(task, cut, False) == k


def test_a_task_without_stages_and_a_bad_signal_are_refused_by_name():
    prog = {k: np.zeros(5, np.float32) for k in KEYS}
    with pytest.raises(ValueError, match="reach-v3.*no per-stage"):
        episode_stage("reach-v3", prog, False)
    with pytest.raises(ValueError, match="grasp_success.*missing"):
        episode_stage("pick-place-v3", {**{k: np.ones(5) for k in KEYS if "grasp" not in k}}, False)
    bad = {**prog, "progress.near_object": np.array([0.0, np.nan, 1.0])}
    with pytest.raises(ValueError, match="non-finite"):
        episode_stage("pick-place-v3", bad, False)
    assert "pick-place-wall-v3" in STAGED_TASKS


def _expert_store(url, task: str, cuts) -> tuple[list, list[str]]:
    """One scripted-expert episode of ``task`` (seed 5) as store rows, committed to a real store at ``url`` once per
    ``(length or None for all of it, success)`` of ``cuts``; returns (rows, episode ids)."""
    from experience_dict.store import ExperienceStore

    env = sim.make_env(task, 0)
    spec = env.spec_dict()
    rows = []
    obs, _ = env.reset(seed=5)
    expert = sim.make_expert(env, noise_std=0.0, seed=5)
    for _ in range(300):
        a = expert(obs)
        nxt, r, term, trunc, info = env.step(a)
        rows.append((obs, a, r, info["progress"]))
        obs = nxt
        if term or trunc:
            break
    env.close()
    w = ExperienceStore.create_or_open(str(url), spec=spec, control_hz=spec.get("control_hz")).writer("t")
    ids = []
    for n, ok in cuts(rows):
        w.begin_episode(unit_id=0, embodiment="sawyer", task=task, policy_version=0, seed=5, is_demo=False)
        for o, a, r, p in rows[:n]:
            w.add_step(o, np.asarray(a, np.float32), r, p)
        ids.append(w.commit(success=ok, termination="truncated"))
    return rows, ids


def _first(rows, signal: str) -> int:
    return next(i for i, row in enumerate(rows) if row[3][signal] >= 0.5)


def test_stall_report_reads_the_episodes_progress_from_a_real_store(tmp_path):
    from experience_dict.store import ExperienceStore

    task = "pick-place-v3"
    # a success, a stall at "reached" (cut at the grasp), a stall at "start" (3 steps)
    rows, ids = _expert_store(tmp_path / "store", task,
                              lambda rows: [(len(rows), True), (_first(rows, "grasp_success"), False), (3, False)])
    assert rows[2][3]["near_object"] < 0.5
    eps = [{"task": task, "episode_id": i, "success": ok} for i, ok in zip(ids, (True, False, False))]
    eps.append({"task": "reach-v3", "episode_id": "x", "success": False})   # not staged: left out
    table = stall_table({"base": eps}, ExperienceStore.open(str(tmp_path / "store")))
    assert table == {"base": {task: {"trials": 3, "successes": 1,
                                     "stall": {"start": 1, "reached": 1, "grasped": 0, "carried": 0}}}}
    got = write_stall_report({"base": eps}, tmp_path / "store", tmp_path / "out")
    assert got == table and "stalled at reached" in (tmp_path / "out" / "stages.md").read_text()
    assert write_stall_report({"base": eps[-1:]}, tmp_path / "store", tmp_path / "none") is None


def test_retrieval_stage_match_and_the_script_on_a_real_store(tmp_path):
    """A failure that stalled after reaching (its onset at its last step) retrieves three windows of a success: before
    its reach, between reach and grasp, after the grasp: the same-stage weight is the middle one's."""
    import subprocess
    import sys
    from pathlib import Path

    from experience_dict.store import ExperienceStore

    task = "pick-place-v3"
    sd = tmp_path / "seed_0"
    rows, ids = _expert_store(sd / "store", task,
                              lambda rows: [(len(rows), True), (_first(rows, "grasp_success"), False)])
    near, grasp = _first(rows, "near_object"), _first(rows, "grasp_success")
    reader = ExperienceStore.open(str(sd / "store"))
    prog = reader.load_episode(ids[0], keys=KEYS)
    assert [stage_at(task, prog, t) for t in (near - 1, near, grasp - 1, grasp)] == [0, 1, 1, 2]
    retrieved = {"contexts": [{"episode_id": ids[1], "task": task, "unit_id": 0, "policy_version": 0,
                               "onset": grasp - 1}],
                 "entries": [{"context": 0, "episode_id": ids[0], "step": near - 2, "weight": 0.5, "own_retry": True},
                             {"context": 0, "episode_id": ids[0], "step": near + 1, "weight": 0.3},
                             {"context": 0, "episode_id": ids[0], "step": grasp + 1, "weight": 0.2}]}
    m = retrieval_stage_match(retrieved, reader)[task]
    assert m["contexts"] == 1 and m["entries"] == 3 and m["context_stage"]["reached"] == 1
    assert (m["same_stage_weight"], m["earlier_stage_weight"], m["later_stage_weight"]) == (0.3, 0.5, 0.2)
    assert m["anchor_stage"] == {"start": 0.5, "reached": 0.3, "grasped": 0.2, "carried": 0.0}
    assert m["own_retry_weight"] == 0.5
    # the script over a seed directory: the learner's audit and the held-out episodes (here the same store)
    (sd / "learner_fert" / "audits").mkdir(parents=True)
    (sd / "learner_fert" / "audits" / "retrieval_audit_round_002.json").write_text(
        __import__("json").dumps({"round": 2, "retrieved": retrieved}))
    (sd / "episodes").mkdir()
    (sd / "episodes" / "base.json").write_text(__import__("json").dumps(
        [{"task": task, "episode_id": i, "success": ok} for i, ok in zip(ids, (True, False))]))
    (sd / "eval_store").symlink_to(sd / "store")
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(repo / "scripts" / "stages.py"), str(sd)], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert "| fert | 2 | pick-place-v3 | 0 / 1 / 0 / 0 | 0.50 / 0.30 / 0.20 / 0.00 | 0.30 | 0.20 | 0.50 | 0.50 |" \
        in (sd / "retrieval_stages.md").read_text()
    assert "| base | pick-place-v3 | 1/2 | 0 | 1 | 0 | 0 |" in (sd / "stages.md").read_text()
    bad = subprocess.run([sys.executable, str(repo / "scripts" / "stages.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=300, check=False)
    assert bad.returncode != 0 and "not a seed directory" in bad.stderr


def test_stage_lookup_reads_each_episode_once_and_agrees_with_stage_at(tmp_path):
    from experience_dict.store import ExperienceStore
    from fleet.stages import StageLookup, stage_series

    task = "pick-place-v3"
    rows, ids = _expert_store(tmp_path / "store", task, lambda rows: [(len(rows), True)])
    reader = ExperienceStore.open(str(tmp_path / "store"))
    prog = reader.load_episode(ids[0], keys=KEYS)
    series = stage_series(task, prog)
    assert (np.diff(series) >= 0).all() and series[0] == 0 and series[-1] == 3
    look = StageLookup(reader)
    near, grasp = _first(rows, "near_object"), _first(rows, "grasp_success")
    assert [look(ids[0], task, t) for t in (near - 1, near, grasp, 10**6)] == [0, 1, 2, 3]
    assert all(look(ids[0], task, t) == stage_at(task, prog, t) for t in range(0, len(rows), 7))
    assert look("anything", "reach-v3", 3) is None and len(look._series) == 1
