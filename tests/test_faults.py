"""Faults inside one trial, tried on a real MuJoCo env, a real Zarr store and a real (tiny) policy: a NaN from the
env or the policy, an action out of range, a diverging simulation, an exception in a trial, a policy that does
not fit the robot, and a second process waiting for a unit's shard. Each must end as the right, named outcome;
nothing non-finite reaches the store; nothing loops."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from experience_dict.store import ExperienceStore
from fleet.coordinator import _plain
from fleet.worker import PolicyLoadError, RobotWorker

REPO = Path(__file__).resolve().parents[1]
CONFIGS = str(REPO / "configs")
from tests.test_fleet import tiny_aed_checkpoint

torch.set_num_threads(1)


def cfg_for(tmp_path, *overrides) -> dict:
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        c = compose("config", overrides=["task=mw_quick", "robot=nominal", f"store.url={tmp_path}/store",
                                         f"fleet.registry_url={tmp_path}/registry", f"fleet.cache_dir={tmp_path}/cache",
                                         "task.max_episode_steps=40", *overrides])
    return _plain(c)


def worker(tmp_path, task="reach-v3", policy=None, unit=0, **kw) -> RobotWorker:
    c = cfg_for(tmp_path)
    return RobotWorker(unit, [task], c, str(tmp_path / "store"), policy or {"kind": "expert"}, **kw)


class _Corrupt:
    """Wraps an env: ``fn(step, out) -> out`` rewrites the ``step``-th ``step()`` result."""

    def __init__(self, env, fn):
        self.env, self.fn, self.n = env, fn, 0

    def __getattr__(self, k):
        return getattr(self.env, k)

    def reset(self, **kw):
        self.n = 0
        return self.env.reset(**kw)

    def step(self, a):
        out = self.fn(self.n, list(self.env.step(a)))
        self.n += 1
        return tuple(out)


def test_non_finite_observation_or_reward_ends_the_episode_as_a_failure(tmp_path):
    w = worker(tmp_path)

    def nan_obs(n, out):
        if n == 4:   # the observation after step 4 (seen at step 5)
            out[0] = {**out[0], "observation.state": np.full(4, np.nan, np.float32)}
        return out

    w.envs["reach-v3"] = _Corrupt(w._env("reach-v3"), nan_obs)
    s = w.run_episode()
    assert s["termination"] == "non_finite_observation" and not s["success"] and s["length"] == 5
    w.envs["reach-v3"] = _Corrupt(w.envs["reach-v3"].env, lambda n, out: out[:1] + [float("nan")] + out[2:]
                                  if n == 2 else out)
    s2 = w.run_episode()
    assert s2["termination"] == "non_finite_reward" and not s2["success"] and s2["length"] == 2
    w.close()
    store = ExperienceStore.open(str(tmp_path / "store"))
    [a, b] = store.episodes()
    assert (a.termination, a.length, a.success, b.termination, b.length) == (
        "non_finite_observation", 5, False, "non_finite_reward", 2)
    st = store.stats(["observation.state", "action", "reward"])
    assert all(np.isfinite(st[k]["mean"]).all() for k in st)
    assert store.verify()["ok"]


class Constant:
    """A policy that always answers ``action`` (version 0)."""
    version = 0

    def __init__(self, action):
        self.action = np.asarray(action, np.float32)

    def reset(self):
        pass

    def select_action(self, obs):
        return self.action.copy()


def test_stored_action_is_the_executed_one(tmp_path):
    w = worker(tmp_path)
    w._acting_policy = lambda task, seed: Constant([1e6, -1e6, 0.5, 3.0])
    s = w.run_episode()
    w.close()
    store = ExperienceStore.open(str(tmp_path / "store"))
    act = store.load_episode(s["episode_id"], ["action"])["action"]
    np.testing.assert_array_equal(act, np.tile(np.array([1.0, -1.0, 0.5, 1.0], np.float32), (len(act), 1)))
    assert store.stats(["action"])["action"]["max"] == [1.0, -1.0, 0.5, 1.0]


def test_diverging_physics_ends_the_episode_as_sim_unstable(tmp_path):
    w = worker(tmp_path, task="push-v3")
    env = w._env("push-v3")

    real_step = env.step

    def step(a):
        if env._t == 10:
            env._mw.data.qvel[:] = np.nan          # the physics diverges during step 10
        return real_step(a)

    env.step = step
    s = w.run_episode()
    w.close()
    assert s["termination"] == "sim_unstable" and not s["success"] and s["length"] == 11
    meta = ExperienceStore.open(str(tmp_path / "store")).episode(s["episode_id"])
    assert meta.termination == "sim_unstable" and meta.length == 11
    # the env itself: the step that diverged says so; MuJoCo's reset did not go on as an ordinary step
    from sim import make_env

    e = make_env("push-v3", unit_id=0)
    e.reset(seed=1)
    e.step(np.zeros(4, np.float32))
    e._mw.data.qvel[:] = np.nan
    _, _, term, trunc, info = e.step(np.zeros(4, np.float32))
    assert term and not trunc and info["termination"] == "sim_unstable" and "BADQVEL" in info["sim_unstable"]
    with pytest.raises(RuntimeError, match="reset"):
        e.step(np.zeros(4, np.float32))
    e.close()


def test_nan_action_and_raising_trial_are_failed_trials_not_crashes(tmp_path):
    w = worker(tmp_path)
    w._acting_policy = lambda task, seed: Constant(np.full(4, np.nan))
    s = w.run_episode()
    assert s["termination"] == "non_finite_action" and s["episode_id"] is None and w.episode_index == 0
    w._acting_policy = RobotWorker._acting_policy.__get__(w)
    w.faults = [{"kind": "raise", "episode": 0, "step": 3}]
    s = w.run_episode()
    assert s["termination"] == "error" and "injected env fault" in s["error"] and s["episode_id"] is None
    w.faults = []
    s = w.run_episode()                                # the unit goes on: same seed, now committed
    assert s["termination"] in ("terminated", "truncated") and s["episode_index"] == 0 and s["episode_id"]
    w.close()
    assert [e.length for e in ExperienceStore.open(str(tmp_path / "store")).episodes()] == [s["length"]]


def test_policy_of_the_wrong_shape_fails_once_clearly(tmp_path):
    ckpt = tiny_aed_checkpoint(tmp_path / "ck", env_dim=6)               # trained for another robot
    w = worker(tmp_path, policy={"kind": "checkpoint", "path": str(ckpt), "device": "cpu"})
    with pytest.raises(PolicyLoadError, match=r"observation.environment_state.*\[6\].*\[17\]"):
        w.run_episodes(1)
    w.close()


@pytest.mark.slow
def test_fleet_script_exits_nonzero_and_says_why(tmp_path):
    """scripts/rollout.py: a policy whose every action is NaN gives up its unit and exits 1 with the reason; a
    checkpoint of the wrong shape exits 2 at once with the feature named."""
    nan_ckpt = tiny_aed_checkpoint(tmp_path / "nan")
    from safetensors.torch import load_file, save_file

    wfile = next(Path(nan_ckpt).glob("*.safetensors"))
    w = load_file(str(wfile))
    w = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in w.items()}
    save_file(w, str(wfile))
    base = [sys.executable, "scripts/rollout.py", "task=mw_quick", "task.tasks=[reach-v3]", "robot=nominal",
            "policy=aed_diffusion", "fleet.units=1", "fleet.episodes_per_unit=2", "task.max_episode_steps=20",
            f"store.url={tmp_path}/store", f"fleet.registry_url={tmp_path}/reg", f"fleet.cache_dir={tmp_path}/c",
            f"hydra.run.dir={tmp_path}/out"]
    env = {**os.environ, "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled"}
    p = subprocess.run(base + [f"fleet.checkpoint={nan_ckpt}"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600, check=False)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "given up" in p.stderr and "non_finite_action" in p.stderr
    res = json.loads((tmp_path / "out" / "fleet_result.json").read_text())
    assert res["terminations"] == {"non_finite_action": 3} and res["dropped_units"] == [0]
    bad = tiny_aed_checkpoint(tmp_path / "bad", env_dim=6)
    p = subprocess.run(base + [f"fleet.checkpoint={bad}", f"hydra.run.dir={tmp_path}/out2"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 2 and "cannot build the acting policy" in p.stderr, p.stderr[-2000:]
    # said once, and not retried: no worker was restarted for it (a wall-time bound failed on a loaded machine)
    assert p.stderr.count("cannot build the acting policy") == 1 and "restarting it" not in p.stderr
    # behind the policy server too: the served version's features are checked against the unit's env, and the
    # refusal is one line (before: a shape error deep in the normalizer, ~370 lines of worker tracebacks, exit 1)
    p = subprocess.run(base + [f"fleet.checkpoint={bad}", f"hydra.run.dir={tmp_path}/out3", "fleet.policy_server=true",
                               "fleet.server_device=cpu", f"store.url={tmp_path}/store3"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.count("cannot build the acting policy") == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "observation.environment_state" in p.stderr and "rollout.log" in p.stderr
    assert "Traceback" in (tmp_path / "out3" / "rollout.log").read_text()    # the full trace, in the run's log


@pytest.mark.slow
def test_second_fleet_on_a_held_store_refuses_in_one_line(tmp_path):
    """Another live process holds unit 0's shard: the fleet script waits ``fleet.shard_wait_s``, then exits 2
    with one line naming the holder and what to do, the traceback in the run's log file, not on the console
    (before: ~140 lines of Ray tracebacks around the WriterBusyError)."""
    held = worker(tmp_path)                           # unit 0's shard, held by this live process
    cmd = [sys.executable, "scripts/rollout.py", "task=mw_quick", "task.tasks=[reach-v3]", "robot=nominal",
           "policy=expert", "fleet.units=1", "fleet.episodes_per_unit=1", "task.max_episode_steps=20",
           "fleet.shard_wait_s=1", f"store.url={tmp_path}/store", f"hydra.run.dir={tmp_path}/out"]
    env = {**os.environ, "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    held.close()
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith("fleet: ")]
    assert len(ours) == 1 and "WriterBusyError" in ours[0] and f"pid {os.getpid()}" in ours[0], p.stderr[-3000:]
    assert "store.url" in ours[0] and "Traceback" not in p.stderr
    assert "WriterBusyError" in (tmp_path / "out" / "rollout.log").read_text()


def test_second_process_waits_for_the_shard_then_continues_the_seeds(tmp_path, caplog):
    """Two fleets on one store: the second unit-0 worker says it waits and for whom, and once it holds the shard
    it continues from the episodes committed meanwhile: no (unit, seed) runs twice."""
    a = worker(tmp_path)
    a.run_episode()
    got = {}
    caplog.set_level(logging.WARNING, logger="fleetmind.worker")

    def second():
        got["w"] = worker(tmp_path)

    th = threading.Thread(target=second)
    th.start()
    deadline = time.monotonic() + 30.0   # the second worker's message, however loaded the machine (1.5 s flaked)
    while "waits up to" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "w" not in got and f"pid {os.getpid()}" in caplog.text and "waits up to" in caplog.text
    a.run_episode()                                   # committed while the second one waits
    a.close()
    th.join(60)
    b = got["w"]
    assert b.episode_index == 2
    b.run_episode()
    b.close()
    eps = ExperienceStore.open(str(tmp_path / "store")).episodes()
    assert len(eps) == 3 and len({(e.unit_id, e.seed) for e in eps}) == 3


@pytest.mark.slow
def test_chaos_run_loses_and_repeats_nothing(tmp_path):
    """scripts/chaos.py, short: workers, the learner and the policy server SIGKILLed at random; the fleet comes
    back, nothing committed is lost, no (unit, seed) runs twice, the store verifies."""
    p = subprocess.run([sys.executable, "scripts/chaos.py", "chaos.kills=5", "chaos.interval_s=3", "chaos.settle_s=20",
                        "chaos.max_wall_s=300", f"hydra.run.dir={tmp_path}/chaos"], cwd=REPO, capture_output=True,
                       text=True, timeout=1200, env={**os.environ, "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled"},
                       check=False)
    rep = json.loads((tmp_path / "chaos" / "chaos.json").read_text())
    assert p.returncode == 0, (rep, p.stderr[-3000:])
    assert rep["kills_total"] == 5 and rep["survived"] and rep["lost_count"] == 0 and rep["duplicated_count"] == 0
    assert rep["verify_ok"] and rep["episodes_after_last_kill"] > 0 and rep["policy_versions"] >= 1


def test_vectorised_evaluation_counts_a_nan_policy_as_failed_trials(tmp_path):
    """The held-out evaluation applies the worker's fault rules: a policy answering NaN fails its trials
    (termination non_finite_action), nothing non-finite is committed, the evaluation does not crash."""
    from safetensors.torch import load_file, save_file

    from fleet.experiment.evaluation import evaluation_plan, run_plan_vectorised

    ckpt = tiny_aed_checkpoint(tmp_path / "nan")
    wfile = next(Path(ckpt).glob("*.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
               for k, v in load_file(str(wfile)).items()}, str(wfile))
    plan = evaluation_plan(["reach-v3"], [100], 2, seed=3)
    out = run_plan_vectorised(cfg_for(tmp_path), str(ckpt), plan, tmp_path / "eval", batch_size=2)
    assert [e["termination"] for e in out] == ["non_finite_action"] * 2
    assert not any(e["success"] for e in out) and all(e["episode_id"] is None for e in out)


def test_head_watch_calls_once_when_the_head_stops_answering():
    """fleet.coordinator.HeadWatch: silent while the head's port answers; once it has been closed for
    ``lost_after_s`` the callback runs once and the exit hook gets HEAD_LOST_EXIT."""
    import socket

    from fleet.coordinator import HEAD_LOST_EXIT, HeadWatch

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    calls, exits = [], []
    watch = HeadWatch(f"127.0.0.1:{srv.getsockname()[1]}", calls.append, lost_after_s=0.5, probe_s=0.1,
                      exit=exits.append).start()
    time.sleep(1.0)
    assert calls == [] and exits == [] and watch.reachable()
    srv.close()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [HEAD_LOST_EXIT] and len(calls) == 1 and calls[0] >= 0.5
    watch.stop()
    with pytest.raises(ValueError, match="host:port"):
        HeadWatch("auto", calls.append)


def test_one_line_refusals_unwraps_causes_and_passes_other_errors(capsys):
    """fleet.refusals.one_line_refusals: a project refusal, even wrapped (``raise ... from``, Ray's ``.cause``),
    is one line on stderr and exit 2; any other error propagates unchanged."""
    from experience_dict.store import WriterBusyError
    from fleet.refusals import REFUSAL_EXIT, one_line_refusals, unwrap

    class Wrapped(RuntimeError):        # Ray's RayTaskError carries the remote exception as ``.cause``
        def __init__(self, cause):
            super().__init__("Traceback (most recent call last):\n  ... 40 lines ...")
            self.cause = cause

    inner = WriterBusyError("writer 'unit-0000' of 's' is held by another live process (pid 1)")
    assert unwrap(Wrapped(inner)) is inner
    with pytest.raises(SystemExit) as e:
        with one_line_refusals("fleet"):
            raise Wrapped(inner)
    assert e.value.code == REFUSAL_EXIT
    err = capsys.readouterr().err
    assert err.strip() == f"fleet: WriterBusyError: {inner}" and "Traceback" not in err
    with pytest.raises(KeyError):
        with one_line_refusals("fleet"):
            raise KeyError("not a refusal")


def test_damaged_store_metadata_is_one_named_refusal_not_a_traceback(tmp_path):
    """Issue 52, item 20: a truncated array ``zarr.json`` of a unit's shard: the unit's worker is refused with one
    ``StoreError`` naming the file (not a bare ``JSONDecodeError``); a missing one under committed rows is refused too
    (creating it anew would erase them); a truncated group ``zarr.json`` is named by ``verify``."""
    from experience_dict.store import ExperienceStore, StoreError

    w = worker(tmp_path)
    w.run_episode(seed=1)
    w.writer.close()
    shard = tmp_path / "store" / "shards" / "unit-0000"
    meta = shard / "lowdim" / "zarr.json"
    good = meta.read_text()
    meta.write_text(good[:40])
    again = worker(tmp_path)
    assert isinstance(again.refusal, StoreError)
    assert "lowdim/zarr.json" in str(again.refusal) and "cannot be read" in str(again.refusal)
    meta.unlink()
    again = worker(tmp_path)
    assert isinstance(again.refusal, StoreError) and "no metadata" in str(again.refusal)
    meta.write_text(good)
    r = ExperienceStore.open(str(tmp_path / "store"))
    assert r.verify()["ok"] and len(r.episodes()) == 1
    (shard / "zarr.json").write_text((shard / "zarr.json").read_text()[:10])
    rep = ExperienceStore.open(str(tmp_path / "store")).verify()
    assert not rep["ok"] and any("shards/unit-0000/zarr.json" in p["error"] for p in rep["problems"])
