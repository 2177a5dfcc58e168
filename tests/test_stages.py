"""Per-stage progress of multi-stage tasks (fleet.stages) on real Meta-World episodes and a real store."""

from __future__ import annotations

import numpy as np
import pytest

import sim
from fleet.stages import STAGE_NAMES, STAGED_TASKS, episode_stage, stall_table, write_stall_report

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


def test_stall_report_reads_the_episodes_progress_from_a_real_store(tmp_path):
    from experience_dict.store import ExperienceStore

    task = "pick-place-v3"
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
    grasp = next(i for i, row in enumerate(rows) if row[3]["grasp_success"] >= 0.5)
    store = ExperienceStore.create_or_open(str(tmp_path / "store"), spec=spec, control_hz=spec.get("control_hz"))
    w = store.writer("t")
    ids = []
    for n, ok in ((len(rows), True), (grasp, False), (3, False)):   # a success, a stall at "reached", at "start"
        w.begin_episode(unit_id=0, embodiment="sawyer", task=task, policy_version=0, seed=5, is_demo=False)
        for o, a, r, p in rows[:n]:
            w.add_step(o, np.asarray(a, np.float32), r, p)
        if n == 3:
            assert rows[2][3]["near_object"] < 0.5
        ids.append(w.commit(success=ok, termination="truncated"))
    eps = [{"task": task, "episode_id": i, "success": ok} for i, ok in zip(ids, (True, False, False))]
    eps.append({"task": "reach-v3", "episode_id": "x", "success": False})   # not staged: left out
    table = stall_table({"base": eps}, ExperienceStore.open(str(tmp_path / "store")))
    assert table == {"base": {task: {"trials": 3, "successes": 1,
                                     "stall": {"start": 1, "reached": 1, "grasped": 0, "carried": 0}}}}
    got = write_stall_report({"base": eps}, tmp_path / "store", tmp_path / "out")
    assert got == table and "stalled at reached" in (tmp_path / "out" / "stages.md").read_text()
    assert write_stall_report({"base": eps[-1:]}, tmp_path / "store", tmp_path / "none") is None
