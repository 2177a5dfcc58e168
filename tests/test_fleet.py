"""The simulated fleet on a real local Ray instance (2 CPUs), real Meta-World envs and a real Zarr store.

One Ray session is shared by the module (Ray starts in ~4 s). Covered: an expert fleet commits the expected
episodes with correct metadata; a worker SIGKILLed mid-episode, one whose env raises and one that hangs past
the episode timeout are restarted and nothing committed is lost; a policy version published during a
run is picked up at the next episode boundary and recorded; a tampered checkpoint is refused; the batched
policy server serves the real AED policy and survives a SIGKILL.
"""

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ray")
import ray
from hydra import compose, initialize_config_dir

from experience_dict.store import ExperienceStore
from fleet.coordinator import Fleet, _plain, collect, ensure_ray
from fleet.registry import CheckpointRegistry

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ensure_ray({"num_cpus": 2, "log_to_driver": False})
    yield
    ray.shutdown()


def make_cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        return compose("config", overrides=["task=mw_quick", "robot=nominal", f"store.url={tmp_path}/store",
                                            f"fleet.registry_url={tmp_path}/registry",
                                            f"fleet.cache_dir={tmp_path}/cache", *overrides])


def tiny_aed_checkpoint(path, seed=0, perturb=0.0, env_dim=17):
    """A small real AED diffusion policy (untrained weights, real tokenizer), saved with save_pretrained.
    ``perturb``: std of Gaussian noise added to every weight (the zero-initialised output layer of an untrained
    denoiser predicts no noise, so untrained policies otherwise act alike whatever their seed)."""
    from experience_dict.tokenizer import ActionTokenizer
    from policies.aed_diffusion import AEDConfig, AEDDiffusionConfig, AEDDiffusionPolicy, MTLossConfig

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    acts = [np.clip(np.cumsum(rng.normal(0, 0.1, (40, 4)), 0), -1, 1).astype(np.float32) for _ in range(6)]
    tok = ActionTokenizer.fit(acts, r=4, relative_dims=[0, 1, 2], absolute_dims=[3], vocab_size=256)
    stats = {"observation.state": {"min": [-0.5, 0.3, 0.0, 0.0], "max": [0.5, 0.9, 0.3, 1.0]},
             "observation.environment_state": {"min": [-1.0] * env_dim, "max": [1.0] * env_dim},
             "action": {"min": [-1.0] * 4, "max": [1.0] * 4}}
    cfg = AEDDiffusionConfig(input_shapes={"observation.state": [4], "observation.environment_state": [env_dim]},
                             dim=32, n_layers=1, n_heads=2, state_hidden=32, horizon=8, n_action_steps=4,
                             action_patch=1, condition_layers=None, num_inference_steps=3, aed=AEDConfig(history_actions=8, group_size=4, memory_queries=2),
                             mt_loss=MTLossConfig(weight=0.0))
    policy = AEDDiffusionPolicy(cfg, stats, tok)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(perturb * torch.randn_like(p))
    return policy.save_pretrained(path)


def run_in_thread(fleet, **kw):
    out = {}
    th = threading.Thread(target=lambda: out.update(result=fleet.run(progress=False, **kw)), daemon=True)
    th.start()
    return th, out


def wait_for(cond, timeout=60.0, what="condition"):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_expert_fleet_commits_expected_episodes(tmp_path):
    cfg = make_cfg(tmp_path, "fleet.units=2", "fleet.tasks_per_unit=1", "policy=expert")
    with Fleet(cfg) as fleet:
        assert fleet.unit_tasks == {0: ["reach-v3"], 1: ["push-v3"]}
        result = fleet.run(episodes_per_unit=3, progress=False)
    assert len(result.episodes) == 6 and not result.failures and result.restarts == {0: 0, 1: 0}
    store = ExperienceStore.open(str(tmp_path / "store"))
    eps = store.episodes()
    assert len(eps) == 6 and store.verify()["ok"]
    by_id = {e.episode_id: e for e in eps}
    for s in result.episodes:
        e = by_id[s["episode_id"]]
        assert (e.unit_id, e.task, e.seed, e.length, e.success, e.policy_version, e.is_demo) == (
            s["unit_id"], s["task"], s["seed"], s["length"], s["success"], -1, False)
        assert e.task == ("reach-v3" if e.unit_id == 0 else "push-v3") and e.embodiment == "sawyer"
        assert e.shard == f"unit-{e.unit_id:04d}"
    assert len({e.seed for e in eps}) == 6  # no seed reused across units or episodes
    assert sorted(e.episode_id for e in store.episodes(unit_id=0)) == [f"unit-0000-{i:06d}" for i in range(3)]
    assert all(e.success for e in eps)  # the scripted expert solves reach and push
    assert result.success_by("task") == {"push-v3": (3, 3), "reach-v3": (3, 3)}
    # the fleet-backed demo collection: episodes_per_task over all tasks, flagged as demonstrations
    res = collect(cfg, episodes_per_task=1, units=[0], store_url=str(tmp_path / "demos"), progress=False)
    demos = ExperienceStore.open(str(tmp_path / "demos")).episodes(is_demo=True)
    assert sorted(e.task for e in demos) == ["drawer-close-v3", "push-v3", "reach-v3"] == sorted(
        s["task"] for s in res.episodes)


def test_killed_raising_and_hung_workers_are_restarted_and_nothing_lost(tmp_path):
    cfg = make_cfg(tmp_path, "fleet.units=2", "policy=expert", "task.tasks=[reach-v3]", "fleet.episode_timeout_s=6")
    faults = {0: {"kind": "sleep", "episode": 1, "step": 10, "seconds": 30, "once_file": str(tmp_path / "f0")},
              1: [{"kind": "raise", "episode": 0, "step": 5, "once_file": str(tmp_path / "f1")},
                  {"kind": "hang", "episode": 2, "step": 5, "once_file": str(tmp_path / "f2")}]}
    with Fleet(cfg, faults=faults) as fleet:
        actor = fleet.actors[0]
        th, out = run_in_thread(fleet, episodes_per_unit=3)
        prog = {}

        def mid_episode():  # unit 0 is in its 2nd episode, 10 steps in (buffered, uncommitted)
            prog.update(ray.get(actor.progress.remote()))
            return prog["episode_index"] == 1 and prog["in_episode"] and prog["step"] == 10

        wait_for(mid_episode, what="unit 0 mid-episode")
        before = ExperienceStore.open(str(tmp_path / "store")).episodes(unit_id=0)
        assert [e.episode_id for e in before] == ["unit-0000-000000"]
        os.kill(prog["pid"], signal.SIGKILL)  # SIGKILL on the worker's process, from outside
        th.join(180)
        result = out["result"]
        new_pid = ray.get(fleet.actors[0].pid.remote())
    assert new_pid != prog["pid"]
    assert result.restarts == {0: 1, 1: 1}, result.failures  # kill; hang past timeout: restart is for a dead process
    # the exception inside unit 1's first trial is a failed trial, not a crash: recorded, the trial run again
    [fault] = result.faulted
    assert fault["unit_id"] == 1 and fault["termination"] == "error" and "injected env fault" in fault["error"]
    assert result.terminations.get("error") == 1 and not result.dropped_units
    store = ExperienceStore.open(str(tmp_path / "store"))
    assert store.verify()["ok"]
    for unit in (0, 1):
        eps = store.episodes(unit_id=unit)
        # committed episodes survive untouched, the interrupted ones were re-run (same seed), none is missing
        assert [e.episode_id for e in eps] == [f"unit-{unit:04d}-{i:06d}" for i in range(3)]
        assert [e.seed for e in eps] == [unit * 1_000_000 + i for i in range(3)]
        assert all(len(store.load_episode(e.episode_id, ["action"])["action"]) == e.length for e in eps)
    assert store.episodes(unit_id=0)[0] == before[0]
    assert len(result.episodes) == 6


@pytest.mark.slow
def test_new_version_picked_up_between_episodes_and_tampered_refused(tmp_path):
    reg = CheckpointRegistry(tmp_path / "registry")
    assert reg.publish(tiny_aed_checkpoint(tmp_path / "ck1", seed=1), {"step": 1}) == 1
    # fleet.episode_timeout_s: on a loaded machine a first episode (torch imported, the checkpoint loaded) outlasted
    # the default 120 s, and the supervisor restarted the worker as hung in the middle of the test
    cfg = make_cfg(tmp_path, "fleet.units=1", "policy=aed_diffusion", "task.tasks=[reach-v3]",
                   "task.max_episode_steps=12", "fleet.episode_timeout_s=900")
    # a slow step in episode 2 lets the test publish while that episode runs
    faults = {0: {"kind": "sleep", "episode": 2, "step": 3, "seconds": 2, "once_file": str(tmp_path / "f")}}
    with Fleet(cfg, faults=faults) as fleet:
        assert fleet.policy["kind"] == "checkpoint" and fleet.policy["version"] == "latest"
        th, out = run_in_thread(fleet, episodes_per_unit=5)
        wait_for(lambda: (p := ray.get(fleet.actors[0].progress.remote()))["episode_index"] == 2 and p["step"] >= 3,
                 timeout=180, what="episode 2 running")   # the worker's first episode imports torch: slow on a loaded machine
        assert reg.publish(tiny_aed_checkpoint(tmp_path / "ck2", seed=2), {"step": 2}) == 2
        th.join(120)
        result = out["result"]
        assert [s["policy_version"] for s in result.episodes] == [1, 1, 1, 2, 2]  # switched at the next boundary
        assert [s["staleness"] for s in result.episodes] == [0, 0, 1, 0, 0]  # episode 2 ended one version behind
        store = ExperienceStore.open(str(tmp_path / "store"))
        assert [e.policy_version for e in store.episodes()] == [1, 1, 1, 2, 2] and store.verify()["ok"]
        # version 3 is tampered with in the registry after publishing, version 4's critic diverged (NaN): the unit
        # refuses each, acts on with version 2 and says so once per version (issue 52, item 19); version 5 is taken
        v3 = reg.publish(tiny_aed_checkpoint(tmp_path / "ck3", seed=3), {"step": 3})
        weights = tmp_path / "registry" / f"v{v3:06d}" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
        assert [s["policy_version"] for s in fleet.run(episodes_per_unit=1, progress=False).episodes] == [2]
        from policies.critic import SuccessCritic, save_critic

        ck4 = tiny_aed_checkpoint(tmp_path / "ck4", seed=4)
        critic = SuccessCritic(4 + 17, 4, 4, members=2, hidden=8,
                               state_keys=["observation.state", "observation.environment_state"])
        with torch.no_grad():
            critic.nets[0][0].weight.fill_(float("nan"))
        save_critic(critic, ck4, 2)
        assert reg.publish(ck4, {"step": 4}) == 4
        assert [s["policy_version"] for s in fleet.run(episodes_per_unit=2, progress=False).episodes] == [2, 2]
        bad = ray.get(fleet.actors[0].progress.remote())["bad_versions"]
        assert set(bad) == {3, 4} and "tampered" in bad[3] and "non-finite" in bad[4]
        assert reg.publish(tiny_aed_checkpoint(tmp_path / "ck5", seed=5), {"step": 5}) == 5
        assert [s["policy_version"] for s in fleet.run(episodes_per_unit=1, progress=False).episodes] == [5]
    eps = ExperienceStore.open(str(tmp_path / "store")).episodes()
    assert [e.policy_version for e in eps] == [1, 1, 1, 2, 2, 2, 2, 2, 5]   # nothing acted with v3 or v4


def test_policy_server_auto_serves_only_where_a_gpu_is(monkeypatch):
    """``fleet.policy_server: auto`` (the default): per-worker inference on CPU (episodes reproducible from their
    seeds), the batched server when the server's device resolves to CUDA; true / false as given."""
    import fleet.acting
    from fleet.coordinator import server_wanted

    assert server_wanted({"policy_server": True}) and not server_wanted({"policy_server": False})
    assert not server_wanted({"policy_server": "auto", "server_device": "cpu"})
    monkeypatch.setattr(fleet.acting, "resolve_device", lambda d: "cuda" if d in ("auto", "cuda") else "cpu")
    assert server_wanted({"policy_server": "auto", "server_device": "auto"})
    assert not server_wanted({"policy_server": "auto", "server_device": "cpu"})
    with pytest.raises(ValueError, match="fleet.policy_server"):
        server_wanted({"policy_server": "yes"})


@pytest.mark.slow
def test_policy_server_batches_and_survives_sigkill(tmp_path):
    ckpt = tiny_aed_checkpoint(tmp_path / "ck", seed=3)
    cfg = make_cfg(tmp_path, "fleet.units=2", "policy=aed_diffusion", f"fleet.checkpoint={ckpt}",
                   "fleet.policy_server=true", "fleet.server_device=cpu", "task.tasks=[reach-v3]",
                   "task.max_episode_steps=40")
    with Fleet(cfg) as fleet:
        assert fleet.server is not None
        server_pid = ray.get(fleet.server.pid.remote())
        th, out = run_in_thread(fleet, episodes_per_unit=2)
        wait_for(lambda: ray.get(fleet.server.stats.remote())["requests"] >= 5, what="server requests")
        os.kill(server_pid, signal.SIGKILL)
        th.join(120)
        result = out["result"]
        stats = fleet.server_stats()
        assert ray.get(fleet.server.pid.remote()) != server_pid
    # the workers retried through the restart: every episode completed, none counted as failed
    assert len(result.episodes) == 4 and result.restarts == {0: 0, 1: 0}
    assert {s["policy_version"] for s in result.episodes} == {0}  # a plain checkpoint dir is UNVERSIONED
    assert stats["requests"] > 0 and stats["max_batch"] >= 1 and stats["latency_ms_p50"] > 0
    assert ExperienceStore.open(str(tmp_path / "store")).verify()["ok"]


def test_evaluation_plan_gives_every_arm_the_same_trials_and_reruns_a_failed_one(tmp_path):
    """Common random numbers: every arm runs the same (task, unit, seed) trials; the same checkpoint on the same
    plan acts identically (env and denoising noise follow the seed); a trial whose episode raised is run
    again with its own seed."""
    from fleet.experiment.evaluation import evaluate_arms, evaluation_plan

    ckpt_a, ckpt_b = tiny_aed_checkpoint(tmp_path / "a", seed=0), tiny_aed_checkpoint(tmp_path / "b", seed=1, perturb=0.5)
    cfg = make_cfg(tmp_path, "task.tasks=[reach-v3,push-v3]", "task.max_episode_steps=25", "eval.seed=7")
    c = _plain(cfg)
    plan = evaluation_plan(["reach-v3", "push-v3"], [100, 101], 3, seed=7)
    assert [(t["task"], t["unit_id"]) for t in plan] == [("reach-v3", 100), ("reach-v3", 101), ("reach-v3", 100),
                                                         ("push-v3", 101), ("push-v3", 100), ("push-v3", 101)]
    assert len({t["seed"] for t in plan}) == 6
    with pytest.raises(ValueError, match="trials_per_task"):
        evaluation_plan(["reach-v3"], [100], 0)
    import shutil

    copy = Path(shutil.copytree(ckpt_a, tmp_path / "a_copy"))   # a registry copy: the same files + a manifest
    (copy / "MANIFEST.json").write_text("{}")
    results = evaluate_arms(c, {"a": str(ckpt_a), "a_again": str(copy), "b": str(ckpt_b)}, tmp_path / "eval", 3,
                            units=[100, 101], progress=False)
    key = lambda e: (e["task"], e["unit_id"], e["seed"])
    want = sorted(key(t) for t in plan)
    assert all(sorted(key(e) for e in eps) == want for eps in results.values())
    by_key = {arm: {key(e): (e["success"], e["length"], round(e["return"], 6)) for e in eps}
              for arm, eps in results.items()}
    assert by_key["a"] != by_key["b"]                  # a different policy acts differently on them
    # same policy, same trials: same outcome, trial by trial (a second evaluation of its own) ...
    again = evaluate_arms(c, {"a": str(ckpt_a)}, tmp_path / "eval_again", 3, units=[100, 101], progress=False)
    assert {key(e): (e["success"], e["length"], round(e["return"], 6)) for e in again["a"]} == by_key["a"]
    # ... so within one call an arm with the same checkpoint (a copy with a registry manifest: the files that
    # act are what count) reuses the episodes instead of running them again
    from experience_dict.store import ExperienceStore
    from fleet.experiment.evaluation import checkpoint_fingerprint

    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(ckpt_a) != checkpoint_fingerprint(ckpt_b)
    assert by_key["a"] == by_key["a_again"] and {e["same_checkpoint_as"] for e in results["a_again"]} == {"a"}
    assert len(ExperienceStore.open(str(tmp_path / "eval" / "eval_store")).episodes()) == 2 * len(plan)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        checkpoint_fingerprint(tmp_path / "nope")
    # a trial whose episode raises is run again (same task, unit and seed); a foreign unit is refused
    faults = {100: {"kind": "raise", "episode": 0, "step": 3, "once_file": str(tmp_path / "once")}}
    with Fleet(c, policy=str(ckpt_a), units=[100, 101], store_url=str(tmp_path / "s2"), faults=faults) as fleet:
        res = fleet.run(plan=plan, progress=False)
        with pytest.raises(ValueError, match="names unit 5"):
            fleet.run(plan=[{"task": "reach-v3", "unit_id": 5, "seed": 1}], progress=False)
    assert res.restarts[100] == 0 and [f["termination"] for f in res.faulted] == ["error"]   # a failed trial, no restart
    assert sorted(key(e) for e in res.episodes) == want                                      # run again, none missing
    # the fleet's workers (one env, one policy call at a time) act exactly as the vectorised evaluation
    assert {key(e): (e["success"], e["length"], round(e["return"], 4)) for e in res.episodes} == \
        {k: (v[0], v[1], round(v[2], 4)) for k, v in by_key["a"].items()}


def test_vectorised_evaluation_does_not_depend_on_the_batch(tmp_path):
    """A trial's outcome is a function of (policy, task, unit, seed) only: one env at a time and 6 envs stepped
    together give the same episodes; every episode is committed to the evaluation store."""
    from experience_dict.store import ExperienceStore
    from fleet.experiment.evaluation import evaluation_plan, run_plan_vectorised

    ckpt = tiny_aed_checkpoint(tmp_path / "a", seed=0, perturb=0.3)
    c = _plain(make_cfg(tmp_path, "task.tasks=[reach-v3,push-v3]", "task.max_episode_steps=25"))
    plan = evaluation_plan(["reach-v3", "push-v3"], [100, 101], 3, seed=11)
    from fleet.experiment.evaluation import env_pool

    pool = env_pool(c)   # this config's envs (earlier tests in this process may have left some)
    for envs in pool.values():
        for env in envs:
            env.close()
    pool.clear()
    one = run_plan_vectorised(c, str(ckpt), plan, tmp_path / "s1", batch_size=1)
    six = run_plan_vectorised(c, str(ckpt), plan, tmp_path / "s6", batch_size=6)
    out = lambda eps: [(e["task"], e["unit_id"], e["seed"], e["success"], e["length"], round(e["return"], 4))  # noqa: E731
                       for e in eps]
    assert out(one) == out(six) and [e["seed"] for e in one] == [t["seed"] for t in plan]
    assert len({e["length"] for e in one}) >= 1 and len(ExperienceStore.open(str(tmp_path / "s6")).episodes()) == 6
    with pytest.raises(ValueError, match="batch_size"):
        run_plan_vectorised(c, str(ckpt), plan, tmp_path / "s0", batch_size=0)
    # eval.max_envs bounds the envs a process keeps (least recently used closed first), with the same episodes:
    # under the default bound (4 x batch_size) the batch-6 wave left one env per trial of a (task, unit) pair, 6 here
    assert sum(len(v) for v in pool.values()) == 6
    bounded = run_plan_vectorised({**c, "eval": {**(c.get("eval") or {}), "max_envs": 2}}, str(ckpt), plan,
                                  tmp_path / "s2", batch_size=2)
    assert out(bounded) == out(one) and sum(len(v) for v in pool.values()) <= 2


def test_denoising_noise_temperature_scales_the_initial_noise(tmp_path):
    """noise_scale multiplies the sampler's initial noise: 1 is the default sampler, 0 removes the noise's
    influence, a (B,) tensor scales each row on its own; a negative scale is refused."""
    from policies.aed_diffusion import AEDDiffusionPolicy

    policy = AEDDiffusionPolicy.from_pretrained(tiny_aed_checkpoint(tmp_path / "p", seed=0, perturb=0.3)).eval()
    policy.reset()
    rng = np.random.default_rng(0)
    obs = {"observation.state": rng.uniform(0, 0.5, (2, 4)).astype(np.float32),
           "observation.environment_state": rng.uniform(-1, 1, (2, 17)).astype(np.float32)}
    policy.history.push_obs({k: torch.as_tensor(v) for k, v in obs.items()})
    batch = policy.history.batch()
    n1, n2 = torch.randn(2, 8, 4), torch.randn(2, 8, 4)
    plain = policy.predict_action_chunk(batch, noise=n1)
    assert torch.equal(plain, policy.predict_action_chunk(batch, noise=n1, noise_scale=1.0))
    hot = policy.predict_action_chunk(batch, noise=n1, noise_scale=3.0)
    assert not torch.allclose(hot, plain, atol=1e-4)
    assert torch.allclose(policy.predict_action_chunk(batch, noise=n1, noise_scale=0.0),
                          policy.predict_action_chunk(batch, noise=n2, noise_scale=0.0))
    rows = policy.predict_action_chunk(batch, noise=n1, noise_scale=torch.tensor([1.0, 3.0]))
    assert torch.allclose(rows[0], plain[0]) and torch.allclose(rows[1], hot[1])
    with pytest.raises(ValueError, match="noise_scale"):
        policy.predict_action_chunk(batch, noise=n1, noise_scale=-1.0)


def test_reexplore_copies_the_store_without_retries_and_explores_its_failures_again(tmp_path):
    """fleet.experiment.protocol.reexplore: the frozen store's episodes but its retries are copied (metadata kept), and its
    training-unit failures are re-attempted at the asked denoising-noise temperature, tagged with the copies'
    ids; the frozen store is untouched and an existing destination is refused."""
    from fleet.experiment.protocol import reexplore

    ckpt = tiny_aed_checkpoint(tmp_path / "ck", seed=2, perturb=0.3)
    cfg = make_cfg(tmp_path, "task.tasks=[reach-v3]", "task.max_episode_steps=20", "fleet.units=1")
    c = _plain(cfg)
    plan = [{"task": "reach-v3", "unit_id": 0, "seed": s} for s in (11, 12)]
    with Fleet(c, policy=str(ckpt), units=[0]) as fleet:
        first = fleet.run(plan=plan, progress=False).episodes
        fails = [e for e in first if not e["success"]]
        assert fails, "an untrained policy should fail a 20-step reach"
        fleet.run(plan=[{**plan[0], "seed": fails[0]["seed"],
                         "explore": {"action_noise_std": 0.3, "retry_of": fails[0]["episode_id"]}}], progress=False)
    src = ExperienceStore.open(c["store"]["url"])
    assert len(src.episodes()) == 3
    c["fert"] = {"retry": {"attempts": 1, "action_noise_std": 0.0, "noise_temperature": 2.5}}
    dst = str(tmp_path / "reexplored")
    rec = reexplore(c, src, str(ckpt), heldout=[100], dst_url=dst, progress=False)
    assert rec["copied"] == 2 and rec["fleet_episodes"] == 2 and rec["failures"] == len(fails)
    assert rec["retries"] == len(fails) and rec["per_attempt"][0]["temperature"] == 2.5
    new = ExperienceStore.open(dst)
    copies = [m for m in new.episodes() if not m.extra.get("retry_of")]
    retries = [m for m in new.episodes() if m.extra.get("retry_of")]
    assert sorted((m.seed, m.success, m.length) for m in copies) == sorted(
        (m.seed, m.success, m.length) for m in src.episodes() if not m.extra.get("retry_of"))
    one = next(m for m in src.episodes() if m.seed == 11 and not m.extra.get("retry_of"))
    copy = next(m for m in copies if m.seed == 11)
    assert copy.extra == one.extra and copy.termination == one.termination
    assert np.array_equal(new.load_episode(copy.episode_id)["action"], src.load_episode(one.episode_id)["action"])
    assert {m.extra["retry_of"] for m in retries} <= {m.episode_id for m in copies if not m.success}
    assert all(m.extra["exploration"] == {"action_noise_std": 0.0, "hold_steps": 8, "noise_temperature": 2.5}
               for m in retries)
    assert len(ExperienceStore.open(c["store"]["url"]).episodes()) == 3 and new.verify()["ok"]
    with pytest.raises(FileExistsError):
        reexplore(c, src, str(ckpt), heldout=[100], dst_url=dst, progress=False)


def test_ray_workers_inherit_the_passive_openmp_wait():
    """ensure_ray sets OMP_WAIT_POLICY=PASSIVE before Ray starts, so every worker's idle OpenMP threads sleep
    (policies/threads.py); a value the environment gave is kept."""
    @ray.remote(num_cpus=0)
    def wait_policy():
        return os.environ.get("OMP_WAIT_POLICY")

    assert ray.get(wait_policy.remote()) == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


def test_a_task_whose_env_fails_at_reset_is_given_up_and_the_unit_serves_its_other_tasks(tmp_path):
    """Issue 52, item 15: every reset of one task's env raises on unit 0. After fleet.max_trial_faults trials of it in
    a row that task is given up on that unit (its failure counted and said, its remaining plan trials not run); the
    unit keeps serving its other task, in a plan and in a per-unit budget; a unit whose every task fails is given up."""
    cfg = make_cfg(tmp_path, "policy=expert", "task.tasks=[reach-v3,button-press-topdown-v3]",
                   "task.max_episode_steps=20", "fleet.units=1", "fleet.trial_retries=0")
    faults = {0: {"kind": "reset_error", "task": "button-press-topdown-v3"}}
    plan = [{"task": t, "unit_id": 0, "seed": s} for s in range(5) for t in ("reach-v3", "button-press-topdown-v3")]
    with Fleet(cfg, faults=faults) as fleet:
        result = fleet.run(plan=plan, progress=False)
        assert sorted(e["seed"] for e in result.episodes) == [0, 1, 2, 3, 4]          # every reach trial ran
        assert {e["task"] for e in result.episodes} == {"reach-v3"} and not result.dropped_units
        [d] = result.dropped_tasks
        assert d["unit"] == 0 and d["task"] == "button-press-topdown-v3" and d["trials_not_run"] == 2
        assert "injected reset fault" in d["why"] and len(result.faulted) == 3
        assert any("button-press-topdown-v3 given up" in f for f in result.failures)
        assert "tasks given up: button-press-topdown-v3 on unit 0" in result.summary()
        per_unit = fleet.run(episodes_per_unit=4, progress=False)      # the worker's own round-robin
        assert len(per_unit.episodes) == 4 and {e["task"] for e in per_unit.episodes} == {"reach-v3"}
        assert [d["task"] for d in per_unit.dropped_tasks] == ["button-press-topdown-v3"]
    faults = {0: [{"kind": "reset_error", "task": t} for t in ("reach-v3", "button-press-topdown-v3")]}
    with Fleet(make_cfg(tmp_path / "b", "policy=expert", "task.tasks=[reach-v3,button-press-topdown-v3]",
                        "task.max_episode_steps=20", "fleet.units=1", "fleet.trial_retries=0"), faults=faults) as fleet:
        result = fleet.run(episodes_per_unit=2, progress=False)
    assert result.dropped_units == [0] and len(result.dropped_tasks) == 2 and not result.episodes


@pytest.mark.parametrize("clock_s", [0.0, -3600.0])
def test_a_trial_committed_by_a_worker_that_then_died_is_not_run_twice(tmp_path, clock_s):
    """A worker SIGKILLed between its commit and its answer (as on a node loss): the coordinator finds the
    committed episode in the store and counts it once; the restarted worker goes on with the next trial. With the
    worker's host clock an hour behind the driver's (issue 52, item 17) the same: "committed" is the store's own
    record of this hand-out (its token), not a comparison of clocks."""
    cfg = make_cfg(tmp_path, "policy=expert", "task.tasks=[reach-v3]", "task.max_episode_steps=40")
    faults = {0: [{"kind": "kill", "episode": 1, "after_commit": True, "once_file": str(tmp_path / "k")},
                  {"kind": "clock", "seconds": clock_s}]}
    plan = [{"task": "reach-v3", "unit_id": 0, "seed": s} for s in (11, 12, 13)]
    with Fleet(cfg, units=[0], faults=faults) as fleet:
        result = fleet.run(plan=plan, progress=False)
    eps = ExperienceStore.open(str(tmp_path / "store")).episodes()
    assert sorted(m.seed for m in eps) == [11, 12, 13]                 # each trial committed exactly once
    assert (tmp_path / "k").exists() and result.restarts[0] == 1 and result.recovered_from_store == 1
    assert sorted(e["seed"] for e in result.episodes) == [11, 12, 13]
    assert {e["episode_id"] for e in result.episodes} == {m.episode_id for m in eps}
    assert "taken from the store" in result.summary()
    assert all(abs(m.start_time - time.time() - clock_s) < 600 for m in eps)   # the worker's own clock
    assert len({m.extra["trial"] for m in eps}) == 3


def test_vector_fleet_runs_failure_retries_tagged_and_batch_independent(tmp_path):
    """The protocol's batched fleet (fleet.experiment.protocol.VectorFleet): failure retries with held action noise and a
    denoising temperature are committed with their tags (retry_of, attempt, exploration), draw their own noise
    (a retry is not the failed trial again), and do not depend on which trials share their batch."""
    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import VectorFleet, run_retries
    from fleet.fert.contexts import retry_of

    ckpt = tiny_aed_checkpoint(tmp_path / "a", seed=0, perturb=0.3)
    c = _plain(make_cfg(tmp_path, "task.tasks=[reach-v3]", "task.max_episode_steps=20"))
    plan = [{"task": "reach-v3", "unit_id": u, "seed": 40 + u} for u in (0, 1, 2)]
    outs = {}
    for bs in (1, 3):
        url = str(tmp_path / f"store{bs}")
        with VectorFleet(c, str(ckpt), url, batch_size=bs, processes=1) as vf:
            first = vf.run(plan=plan, progress=False).episodes
            fails = [e for e in first if not e["success"]]
            rec = run_retries(vf, fails, {"attempts": 2, "action_noise_std": 0.3, "noise_temperature": 1.5},
                              heldout=[100], n_fleet_episodes=len(plan), progress=False)
            assert vf.steps == sum(e["length"] for e in first) + sum(e["length"] for e in rec["episodes"])
        reader = ExperienceStore.open(url)
        retries = [m for m in reader.episodes() if retry_of(m)]
        assert len(retries) == rec["retries"] >= len(fails) == rec["failures"] == 3
        ex = retries[0].extra["exploration"]
        assert ex["noise_temperature"] == 1.5 and ex["action_noise_std"] == 0.3 and retries[0].extra["attempt"] == 0
        assert {retry_of(m) for m in retries} <= {e["episode_id"] for e in first}
        acts = {(int(m.seed), retry_of(m) is not None, m.extra.get("attempt")):
                reader.load_episode(m.episode_id, keys=["action"])["action"] for m in reader.episodes()}
        outs[bs] = acts
        # a retry explores: its actions differ from the failed trial's from the same reset seed
        s = int(first[0]["seed"])
        assert not np.allclose(acts[(s, True, 0)][:8], acts[(s, False, None)][:8])
    assert outs[1].keys() == outs[3].keys()
    for k in outs[1]:
        np.testing.assert_allclose(outs[1][k], outs[3][k], atol=1e-4)   # batch-size-dependent float sums: ~1e-5
