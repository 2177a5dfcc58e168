"""Failure onset from progress traces (fleet/fert/failure.py)."""

import numpy as np
import pytest

from fleet.fert.failure import context_steps, find_failure_onset, onset_from_score, progress_score


def test_onset_on_hand_made_trace():
    # rises to 0.6 by step 4, noise below the tolerance afterwards, a last real improvement at step 7
    p = np.array([0.0, 0.1, 0.3, 0.5, 0.6, 0.59, 0.61, 0.7, 0.69, 0.71, 0.7, 0.68, 0.7, 0.65, 0.6])
    assert onset_from_score(p, tolerance=0.02) == 7          # 0.71 at step 9 is within 0.02 of 0.7
    assert onset_from_score(p, tolerance=0.0) == 9           # every rise counts without tolerance
    assert onset_from_score(p, tolerance=0.2) == 4           # 0.6 + 0.2 >= everything after (0.5 + 0.2 < 0.71)
    # monotone increasing to the end: never stops improving -> the last step
    assert onset_from_score(np.linspace(0, 1, 20), 0.01) == 19
    # never improves at all -> step 0
    assert onset_from_score(np.array([0.5, 0.4, 0.3, 0.5]), 0.0) == 0
    # a late recovery above the plateau moves the onset past it
    assert onset_from_score(np.array([0.0, 0.5, 0.5, 0.5, 0.5, 0.9, 0.9]), 0.02) == 5


def test_progress_score_combines_metaworld_signals():
    T = 10
    d = np.linspace(0.2, 0.1, T)                             # obj_to_target halves
    prog = {"progress.in_place_reward": np.linspace(0.0, 0.5, T), "progress.obj_to_target": d,
            "progress.unscaled_reward": np.full(T, 3.0),      # constant -> dropped
            "progress.near_object": np.ones(T)}               # not a default signal -> ignored
    s = progress_score(prog)
    np.testing.assert_allclose(s, (np.linspace(0, 0.5, T) + (1 - d / 0.2)) / 2)
    # zero initial distance (hammer / assembly report obj_to_target = 0): dropped, not a division by zero
    assert progress_score({"progress.obj_to_target": np.r_[0.0, np.ones(4)]}) is None
    with pytest.raises(ValueError, match="progress.obj_to_target"):
        progress_score({"progress.in_place_reward": np.zeros(5) + np.arange(5),
                        "progress.obj_to_target": np.arange(4.0) + 1})
    with pytest.raises(ValueError, match="kind"):
        progress_score(prog, signals={"progress.in_place_reward": ("speed", 1.0)})


def test_find_failure_onset_and_fallback():
    T, W = 60, 8
    ipr = np.r_[np.linspace(0, 0.4, 20), np.full(40, 0.4)] + 0.005 * np.sin(np.arange(T))
    onset, method = find_failure_onset({"progress.in_place_reward": ipr}, T, W, tolerance=0.02)
    assert method == "progress" and 15 <= onset <= 20
    # fallback: no progress keys, or only constant / non-finite ones -> last step, context = last W steps
    # ... or signals that never rise more than the tolerance above their start (no progress at all)
    for prog in ({}, {"progress.in_place_reward": np.zeros(T)},
                 {"progress.in_place_reward": np.full(T, np.nan)},
                 {"progress.in_place_reward": 0.1 + 0.01 * np.sin(np.arange(T))},
                 {"progress.obj_to_target": np.linspace(0.17, 0.18, T)}):           # object drifts away
        onset, method = find_failure_onset(prog, T, W)
        assert (onset, method) == (T - 1, "fallback")
        np.testing.assert_array_equal(context_steps(onset, W), np.arange(T - W, T))
    with pytest.raises(ValueError, match="length"):
        find_failure_onset({"progress.in_place_reward": ipr}, T + 1, W)
    with pytest.raises(ValueError, match="window"):
        find_failure_onset({}, T, 0)
    with pytest.raises(ValueError, match="tolerance"):
        onset_from_score(ipr, -1.0)


def test_onset_on_real_metaworld_rollouts():
    """The scripted expert stops (zero motion) at step 25: push-v3's onset is where the object stops moving;
    drawer-close-v3's signals never improve while the hand approaches, so it falls back to the last W steps."""
    pytest.importorskip("mujoco")
    from sim import make_env, make_expert

    for task, expect in (("push-v3", "progress"), ("drawer-close-v3", "fallback")):
        env = make_env(task, unit_id=0)
        obs, _ = env.reset(seed=3)
        expert = make_expert(env, noise_std=0.0, seed=1)
        prog, success = [], False
        for t in range(80):
            a = expert.act(obs) if t < 25 else np.array([0, 0, 0, -1], np.float32)
            obs, _, _, _, info = env.step(a)
            prog.append(info["progress"])
            success |= bool(info["success"])
        env.close()
        assert not success
        onset, method = find_failure_onset({f"progress.{k}": np.array([p[k] for p in prog]) for k in prog[0]},
                                           len(prog), window=8)
        assert method == expect, (task, onset, method)
        if expect == "progress":
            assert 24 <= onset <= 35, onset
        else:
            assert onset == len(prog) - 1
