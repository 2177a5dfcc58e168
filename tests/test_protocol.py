"""The fleet-learning protocol: fixed plans, failure retries (never on held-out units), exploration, the
progress gate on a hand-made episode, the task-relative key, own retries first, the arm registry, the
seed-level bootstrap, and the same demonstrations and base weights from the same config and seed."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from fleet.experiment.arms import ARMS, fert_config, get_arms
from fleet.experiment.protocol import fleet_plan, retry_plan
from fleet.experiment.tables import paired_differences, paired_over_seeds
from fleet.fert.contexts import FailureContext
from fleet.fert.failure import progress_advantage, progress_score, segment_gain
from fleet.fert.index import SuccessIndex
from fleet.fert.keys import RelativeEmbedder
from fleet.fert.retrieve import retrieve
from fleet.worker import Exploration

torch.set_num_threads(1)


def test_fleet_plan_is_fixed_and_seeded():
    a = fleet_plan(["reach-v3", "push-v3"], [0, 1], 3, seed=0, round_idx=0)
    assert a == fleet_plan(["reach-v3", "push-v3"], [0, 1], 3, seed=0, round_idx=0)
    assert len(a) == 6 and [t["unit_id"] for t in a] == [0, 1, 0, 1, 0, 1]
    assert [t["task"] for t in a] == ["reach-v3", "reach-v3", "push-v3", "push-v3", "reach-v3", "reach-v3"]
    assert len({t["seed"] for t in a}) == 6
    other_seed = {t["seed"] for t in fleet_plan(["reach-v3", "push-v3"], [0, 1], 3, seed=1)}
    other_round = {t["seed"] for t in fleet_plan(["reach-v3", "push-v3"], [0, 1], 3, seed=0, round_idx=1)}
    assert not other_seed & {t["seed"] for t in a} and not other_round & {t["seed"] for t in a}
    with pytest.raises(ValueError, match="fleet_plan"):
        fleet_plan([], [0], 1, 0)


def test_retries_never_on_heldout_units_nor_of_retries():
    fails = [{"episode_id": "unit-0000-000001", "task": "reach-v3", "unit_id": 0, "seed": 11},
             {"episode_id": "unit-0100-000001", "task": "reach-v3", "unit_id": 100, "seed": 12},
             {"episode_id": "unit-0001-000004", "task": "push-v3", "unit_id": 1, "seed": 13, "retry_of": "x"}]
    cfg = {"attempts": 3, "action_noise_std": 0.2, "growth": 2.0, "hold_steps": 4}
    plan = retry_plan(fails, cfg, attempt=1, heldout=[100], budget=10)
    assert [(t["unit_id"], t["seed"], t["task"]) for t in plan] == [(0, 11, "reach-v3")]
    ex = plan[0]["explore"]
    assert ex["retry_of"] == "unit-0000-000001" and ex["attempt"] == 1 and ex["action_noise_std"] == pytest.approx(0.4)
    assert ex["noise_temperature"] == 1.0                         # default: the trained sampler
    hot = retry_plan(fails, {**cfg, "noise_temperature": 1.5, "temperature_growth": 2.0}, 2, [100], 10)
    assert hot[0]["explore"]["noise_temperature"] == pytest.approx(6.0)
    assert retry_plan(fails, cfg, 0, heldout=[100], budget=0) == []
    with pytest.raises(ValueError, match="unknown keys"):
        retry_plan(fails, {"noise": 1}, 0, [], 1)


def test_exploration_noise_is_held_reproducible_and_clipped():
    ex = Exploration(action_noise_std=0.5, hold_steps=4, retry_of="e", attempt=0)
    acts = np.stack([ex.perturb(np.array([0.9, 0.0, -0.9, 0.7], np.float32), t, seed=3) for t in range(8)])
    assert np.all(np.abs(acts) <= 1.0) and np.all(acts[:, 3] == np.float32(0.7))   # gripper untouched
    assert np.allclose(acts[0, :3] - [0.9, 0, -0.9], np.clip(acts[0, :3], -1, 1) - [0.9, 0, -0.9])
    assert np.allclose(acts[0], acts[3]) and not np.allclose(acts[0], acts[4])    # held for 4 steps, then redrawn
    again = Exploration(action_noise_std=0.5, hold_steps=4, retry_of="e", attempt=0)
    assert np.allclose(acts, [again.perturb(np.array([0.9, 0.0, -0.9, 0.7], np.float32), t, 3) for t in range(8)])
    other = Exploration(action_noise_std=0.5, hold_steps=4, attempt=1).perturb(np.zeros(4, np.float32), 0, 3)
    assert not np.allclose(other, Exploration(0.5, 4, attempt=0).perturb(np.zeros(4, np.float32), 0, 3))
    assert ex.tags() == {"retry_of": "e", "attempt": 0,
                         "exploration": {"action_noise_std": 0.5, "hold_steps": 4, "noise_temperature": 1.0}}
    modal = Exploration.from_dict({"action_noise_std": 0.0, "noise_temperature": 2.0, "retry_of": "e"})
    a = np.array([1.5, 0.2, -0.3, 0.7], np.float32)
    assert np.array_equal(modal.perturb(a, 0, 3), a)          # no action noise: the policy's own action, as is
    assert modal.tags()["exploration"] == {"action_noise_std": 0.0, "hold_steps": 8, "noise_temperature": 2.0}
    with pytest.raises(ValueError, match="noise_temperature"):
        Exploration(noise_temperature=0.0)
    with pytest.raises(ValueError, match="action_noise_std"):
        Exploration(action_noise_std=float("nan"))
    with pytest.raises(ValueError, match="unknown keys"):
        Exploration.from_dict({"std": 1.0})


def test_progress_gate_on_a_hand_made_episode():
    # a success that closes the distance over steps 0..29, then waits at the goal for 10 steps
    d = np.r_[np.linspace(0.3, 0.0, 30), np.zeros(10)]
    score = progress_score({"progress.obj_to_target": d, "progress.in_place_reward": 1 - d / 0.3})
    gain = segment_gain(score, np.arange(40), horizon=8)
    assert gain[0] == pytest.approx(8 / 29, rel=1e-6) and gain[35] == 0.0            # the tail teaches "stop here"
    # the failure stalled: it gained 0.01 over the horizon after its onset
    passed, w = progress_advantage(gain, failure_gain=0.01, min_gain=0.02, beta=0.05, max_weight=20.0)
    assert passed[:20].all() and not passed[30:].any() and (w[30:] == 0).all()
    assert w[0] == pytest.approx(min(np.exp((8 / 29 - 0.01) / 0.05), 20.0))
    # a failure that regressed still needs a segment that makes progress of its own
    passed, _ = progress_advantage(np.array([0.01, 0.05]), failure_gain=-0.5, min_gain=0.02)
    assert passed.tolist() == [False, True]
    with pytest.raises(ValueError):
        progress_advantage(gain, 0.0, beta=0.0)


def _episode(hand, obj, goal, grip=0.5):
    T = len(hand)
    env = np.zeros((T, 17), np.float32)
    env[:, 0:3], env[:, 14:17] = obj, goal
    return {"observation.state": np.c_[hand, np.full(T, grip)].astype(np.float32),
            "observation.environment_state": env}


def test_relative_key_is_in_metres_and_sees_the_goal():
    emb = RelativeEmbedder(frames=3, gripper_scale=0.05)
    T = 5
    hand = np.linspace([0.0, 0.6, 0.1], [0.0, 0.6, 0.2], T)
    data = _episode(hand, obj=np.tile([0.1, 0.6, 0.0], (T, 1)), goal=np.tile([0.0, 0.7, 0.3], (T, 1)))
    z = emb.embed_episode(data, np.array([4]))[0]
    assert z.shape == (16,)
    assert np.allclose(z[0:3], hand[4] - [0.1, 0.6, 0.0]) and np.allclose(z[3:6], hand[4] - [0.0, 0.7, 0.3])
    assert np.allclose(z[6:9], [0.1, -0.1, -0.3]) and np.allclose(z[9:12], hand[4] - hand[2])
    assert np.allclose(z[15], 0.025)
    # shifting the whole scene moves no relative term: the key is translation invariant
    shifted = {k: v.copy() for k, v in data.items()}
    shifted["observation.state"][:, :3] += 0.2
    shifted["observation.environment_state"][:, 0:3] += 0.2
    shifted["observation.environment_state"][:, 14:17] += 0.2
    assert np.allclose(emb.embed_episode(shifted, np.array([4]))[0], z, atol=1e-6)


class _Meta:
    def __init__(self, eid, task="reach-v3", unit=0, success=True, extra=None, length=20, is_demo=False):
        self.episode_id, self.task, self.unit_id, self.success = eid, task, unit, success
        self.is_demo, self.extra, self.length, self.policy_version = is_demo, extra or {}, length, 1


def test_own_retry_ranks_first_and_gate_drops_stalled_segments():
    emb = RelativeEmbedder(frames=2)
    idx = SuccessIndex(emb, gate_horizon=4, tail_steps=2)
    T = 20
    goal = np.tile([0.0, 0.8, 0.2], (T, 1))
    obj = np.tile([0.0, 0.6, 0.0], (T, 1))

    def ep(y_end):
        hand = np.linspace([0.0, 0.5, 0.1], [0.0, y_end, 0.2], 13)      # arrives at step 12, then waits
        hand = np.r_[hand, np.repeat(hand[-1:], T - 13, axis=0)]
        data = _episode(hand, obj, goal)
        d = np.linalg.norm(hand - goal, axis=1)
        data["progress.obj_to_target"] = d
        return data

    # a fleet success far from the failure's state, and the failure's own retry
    idx.add_episode(_Meta("unit-0001-000000", unit=1), ep(0.8))
    idx.add_episode(_Meta("unit-0000-000009", unit=0, extra={"retry_of": "unit-0000-000003"}), ep(0.8))
    assert idx.retries_of == {"unit-0000-000003": ["unit-0000-000009"]}
    assert idx.size("reach-v3") == 2 * (T - 2)                    # the last tail_steps anchors are not indexed
    fail = ep(0.6)
    q = emb.embed_episode(fail, np.array([10]))
    ctx = FailureContext("unit-0000-000003", "reach-v3", 0, 1, 10, gain=0.0)
    r = retrieve(idx, q, [ctx], top_k=3, gate={"min_gain": 0.02, "beta": 0.05, "max_weight": 20.0})
    assert r.own_retry[0] and r.episode_id[0] == "unit-0000-000009"
    assert np.all(r.gain > 0.02) and np.isclose(r.weight.sum(), 1.0)
    assert np.all(np.isfinite(r.distance)) and r.distance.max() < 0.5        # metres
    # no gate: a neighbour at the end of an episode (no progress left) may be retrieved
    r0 = retrieve(idx, q, [ctx], top_k=40, own_retries_first=False)
    assert not r0.own_retry.any() and (r0.gain <= 0.02).any()
    # own retries only: the recovered failure gets its retry alone, an unrecovered one retrieves nothing
    other = FailureContext("unit-0000-000004", "reach-v3", 0, 1, 10, gain=0.0)
    r1 = retrieve(idx, np.r_[q, q], [ctx, other], top_k=3, neighbours="own_retries")
    assert set(r1.episode_id) == {"unit-0000-000009"} and r1.own_retry.all() and (r1.context == 0).all()
    assert r1.context_weight[1] == 0.0 and np.isclose(r1.weight.sum(), 1.0)
    with pytest.raises(ValueError, match="neighbours"):
        retrieve(idx, q, [ctx], neighbours="nearby")


def test_retry_share_repeats_retries_to_the_asked_share():
    from fleet.experiment.arms import with_retry_share

    eps = [_Meta(f"unit-0000-{i:06d}", length=100) for i in range(9)]
    eps += [_Meta("unit-0000-000009", length=50, extra={"retry_of": "unit-0000-000003"})]
    out = with_retry_share(eps, 0.5)
    n_retry = sum(m.length for m in out if m.extra.get("retry_of"))
    assert n_retry == 50 * 18 and sum(m.length for m in out) == 900 + 900    # 18 copies: half the windows
    assert with_retry_share(eps[:9], 0.5) == eps[:9]                          # no retries: unchanged
    with pytest.raises(ValueError, match="retry_share"):
        with_retry_share(eps, 1.0)


def test_each_offline_arm_trains_on_its_own_episodes():
    from fleet.experiment.arms import arm_episodes

    demo, fleet_ok = _Meta("unit-0001-000000", unit=1, is_demo=True), _Meta("unit-0000-000001")
    retry = _Meta("unit-0000-000002", extra={"retry_of": "unit-0000-000000"})
    held = _Meta("unit-0100-000000", unit=100)
    eps = [demo, fleet_ok, retry, held]

    def ids(arm):
        return [m.episode_id for m in arm_episodes(ARMS[arm], eps, heldout=[100])]

    assert ids("demos_bc") == [demo.episode_id]
    assert ids("filtered_bc") == [demo.episode_id, fleet_ok.episode_id]
    assert ids("filtered_bc_retries") == [demo.episode_id, fleet_ok.episode_id, retry.episode_id]
    assert ids("bc_retries_focus").count(retry.episode_id) == 2            # 40 other steps, 20 of a retry: x2


def test_arm_registry_refuses_unknown_arms_and_merges_overrides():
    assert [a.name for a in get_arms(["base", "fert"])] == ["base", "fert"]
    with pytest.raises(ValueError, match="unknown arms \\['ferd'\\]"):
        get_arms(["base", "ferd"])
    with pytest.raises(ValueError, match="repeated"):
        get_arms(["base", "base"])
    with pytest.raises(ValueError, match="add fert"):                # the critic arms are made from fert's
        get_arms(["base", "base_critic"])
    assert [a.critic for a in get_arms(["fert", "fert_no_critic", "base_critic"])] == [None, "drop", "fert"]
    cfg = {"fert": {"key": "relative", "gate": {"enabled": True, "beta": 0.05}}}
    assert fert_config(cfg, ARMS["fert_no_gate"])["fert"]["gate"] == {"enabled": False, "beta": 0.05}
    assert fert_config(cfg, ARMS["fert_abs_key"])["fert"]["key"] == "absolute"
    assert cfg["fert"]["gate"]["enabled"] is True                   # the caller's config is untouched


def _eps(success, task="reach-v3"):
    return [{"task": task, "unit_id": 100, "seed": i, "success": bool(s)} for i, s in enumerate(success)]


def test_seed_bootstrap_counts_training_noise():
    rng = np.random.default_rng(0)
    base = rng.random(100) < 0.5
    one = paired_over_seeds({0: {"a": _eps(base | (rng.random(100) < 0.2)), "b": _eps(base)}}, [("a", "b")], n_boot=2000)
    ref = paired_differences({"a": _eps(base | (rng.random(100) < 0.2)), "b": _eps(base)}, [("a", "b")])
    assert one["pairs"][0]["average"]["pairs"] == ref["pairs"][0]["average"]["pairs"] == 100
    # seeds that disagree (+20 on one, 0 on two): the interval over seeds is wider than the trial-only one
    res = {}
    for s, lift in ((0, 0.4), (1, 0.0), (2, 0.0)):
        b = rng.random(100) < 0.5
        res[s] = {"a": _eps(b | (rng.random(100) < lift)), "b": _eps(b)}
    over = paired_over_seeds(res, [("a", "b")], n_boot=4000)["pairs"][0]
    pooled = paired_differences({"a": [e | {"seed": e["seed"] + 1000 * s} for s in res for e in res[s]["a"]],
                                 "b": [e | {"seed": e["seed"] + 1000 * s} for s in res for e in res[s]["b"]]},
                                [("a", "b")])["pairs"][0]
    assert over["average"]["diff"] == pytest.approx(pooled["average"]["diff"])
    w_over = over["average"]["ci95"][1] - over["average"]["ci95"][0]
    w_trials = pooled["average"]["ci95"][1] - pooled["average"]["ci95"][0]
    assert w_over > 1.3 * w_trials and over["average"]["seeds"] == 3
    assert set(over["per_seed"]) == {"0", "1", "2"} and over["per_seed"]["0"] > 0.1


@pytest.mark.slow
def test_same_config_and_seed_give_same_demos_and_base(tmp_path):
    """Two demo collections from the same plan hold the same trials and actions; the same demos and seed
    train bit-identical base weights on CPU."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import collect_demos
    from policies.aed_diffusion.training import train_policy

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cfg = {"robot": {"train_units": [0, 1], "heldout_units": [100]}, "obs": {"images": False},
           "task": {"tasks": ["reach-v3", "push-v3"], "max_episode_steps": 60, "steps_after_success": 5},
           "store": {"url": "", "image_codec": "h264", "image_crf": 23},
           "fleet": {"num_cpus": 2, "units": 2, "episode_timeout_s": 120, "max_restarts": 1, "max_recreates": 1,
                     "torch_threads": 1}, "policy": {}, "seed": 0}
    runs = []
    for k in range(2):
        url = str(tmp_path / f"store{k}")
        res = collect_demos(cfg, [0, 1], demos_per_task=2, noise_std=0.1, seed=7, store_url=url, progress=False)
        assert res["successes"] == {"reach-v3": 2, "push-v3": 2}
        reader = ExperienceStore.open(url)
        assert (reader.meta["image_codec"], reader.meta["image_crf"]) == ("h264", 23)   # the fleet made it so
        eps = sorted(reader.episodes(is_demo=True, success=True), key=lambda m: (m.unit_id, m.seed))
        trials = [(m.task, int(m.unit_id), int(m.seed)) for m in eps]
        actions = [reader.load_episode(m.episode_id, keys=["action"])["action"] for m in eps]
        pol = OmegaConf.merge(OmegaConf.load("configs/policy/aed_diffusion.yaml"),
                              {"dim": 32, "n_layers": 1, "n_heads": 2, "state_hidden": 32,
                               "aed": {"tokenizer_vocab_size": 128}})
        pcfg = OmegaConf.to_container(pol, resolve=True)      # policies.factory.make_policy builds it
        out = train_policy({"steps": 6, "batch_size": 8, "progress": False, "seed": 3, "num_threads": 1,
                            "wandb": {"enabled": False}}, tmp_path / f"base{k}", policy_cfg=pcfg, reader=reader,
                           episodes=eps, device="cpu")
        weights = load_file(str(out["checkpoint"] / "model.safetensors"))
        runs.append((trials, actions, weights))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 4
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert runs[0][2].keys() == runs[1][2].keys()
    assert all(torch.equal(runs[0][2][k], runs[1][2][k]) for k in runs[0][2])


def test_aed_key_embeds_the_action_history_in_metres(tmp_path):
    """The AED part of the key: the policy's dictionary embeds the actions before the anchor; different
    histories give different keys, the relative part is untouched, a policy without AED is refused."""
    from fleet.fert.keys import aed_history_encoder
    from policies.aed_diffusion import AEDDiffusionPolicy
    from tests.test_fleet import tiny_aed_checkpoint

    policy = AEDDiffusionPolicy.from_pretrained(tiny_aed_checkpoint(tmp_path / "p", seed=0, perturb=0.3)).eval()
    enc, scale, H = aed_history_encoder(policy, scale_m=0.05)
    assert H == 8 and scale == pytest.approx(0.05 / np.sqrt(32))
    emb = RelativeEmbedder(frames=3, extra=enc, extra_scale=scale, history_actions=H)
    T = 30
    data = _episode(np.linspace([0.0, 0.6, 0.1], [0.0, 0.6, 0.2], T), np.tile([0.1, 0.6, 0.0], (T, 1)),
                    np.tile([0.0, 0.7, 0.3], (T, 1)))
    rng = np.random.default_rng(0)
    data["action"] = np.clip(rng.normal(0, 0.5, (T, 4)), -1, 1).astype(np.float32)
    w = emb.windows(data, np.array([2, 20]))
    assert w["action"].shape == (2, 8, 4) and w["action_is_pad"][0].sum() == 6 and not w["action_is_pad"][1].any()
    z = emb.embed_episode(data, np.array([2, 20, 25]))
    assert z.shape == (3, 16 + 32)
    assert np.allclose(z[:, :16], RelativeEmbedder(frames=3).embed_episode(data, np.array([2, 20, 25])))
    d = np.linalg.norm(z[1, 16:] - z[2, 16:])
    assert 0.0 < d < 0.5                                             # metres-comparable, not raw embedding units
    base = AEDDiffusionPolicy.from_pretrained(tiny_aed_checkpoint(tmp_path / "q", seed=1))
    base.config.aed.enabled = False
    with pytest.raises(ValueError, match="no Action Experience Dictionary"):
        aed_history_encoder(base)


def test_shifted_robot_demonstrations_run_on_their_own_near_nominal_units():
    """``robot=shifted``: the demonstration units (200, 201) are neither training nor held-out units; the
    demonstration stage's config makes them known to ``make_env`` with every variation range x 0.25 (so latency
    0), and the unit table shows them with that variation."""
    from hydra import compose, initialize_config_dir

    from fleet.experiment.bases import demo_config
    from fleet.experiment.reports import unit_table
    from sim import make_env, unit_lists

    with initialize_config_dir(config_dir=os.path.abspath("configs"), version_base=None):
        from omegaconf import OmegaConf

        cfg = compose("config", overrides=["robot=shifted"])
        c = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("robot", "obs", "task")}
    dc, units = demo_config(c)
    assert units == [200, 201]
    assert unit_lists(dc["robot"])[0] == list(range(16)) + [200, 201]    # the fleet's first units unchanged
    assert unit_lists(dc["robot"])[1] == unit_lists(c["robot"])[1]
    with pytest.raises(ValueError, match="unknown unit id 200"):
        make_env(task="reach-v3", unit_id=200, robot_cfg=c["robot"], obs_cfg=c["obs"], task_cfg=c["task"])
    env = make_env(task="reach-v3", unit_id=200, robot_cfg=dc["robot"], obs_cfg=c["obs"], task_cfg=c["task"])
    try:
        gain_range = 0.25 * c["robot"]["variation"]["action_gain"]
        assert env.unwrapped.unit.action_latency == 0
        assert np.all(np.abs(np.asarray(env.unwrapped.unit.action_gain) - 1.0) <= gain_range + 1e-9)
        obs, _ = env.reset(seed=0)
        assert np.all(np.isfinite(obs["observation.state"]))
    finally:
        env.close()
    row = next(r for r in unit_table(c, [0, 200, 100]).splitlines() if r.startswith("| 200 |"))
    assert row.split("|")[3].strip() == "0"          # latency column


def test_tasks_lost_with_and_without_holm():
    """The gate's per-task rule on recorded validations: experiment 33's mw10 round 0 (+6.0 points overall, 33/15)
    lost bin-picking on 0 wins / 4 losses: rejected per task at alpha 0.1 (p = 0.0625), not under Holm over ten
    tasks; experiment 32's button-press 0 / 5 (p = 0.031 < 0.1 / 3) is lost under both."""
    from fleet.fert.gate import tasks_lost

    mw10 = {"assembly": (3, 2, 1), "basketball": (7, 3, 1), "bin-picking": (-13, 0, 4), "button-press": (10, 7, 4),
            "door-open": (13, 4, 0), "drawer-close": (0, 0, 0), "hammer": (7, 4, 2), "push": (-7, 1, 3),
            "reach": (10, 3, 0), "window-open": (30, 9, 0)}
    cells = {t: {"diff": d / 100, "wins": w, "losses": lo} for t, (d, w, lo) in mw10.items()}
    assert tasks_lost(cells, 0.1, 0.1) == ["bin-picking"]
    assert tasks_lost(cells, 0.1, 0.1, "holm") == []
    three = {"button-press": {"diff": -0.167, "wins": 0, "losses": 5}, "reach": {"diff": 0.1, "wins": 3, "losses": 0},
             "window-open": {"diff": -0.067, "wins": 2, "losses": 4}}
    assert tasks_lost(three, 0.1, 0.1) == tasks_lost(three, 0.1, 0.1, "holm") == ["button-press"]
    assert tasks_lost(three, 0.2, 0.1, "holm") == []            # within the tolerance: not lost
    with pytest.raises(ValueError, match="validate_task_correction"):
        tasks_lost(three, 0.1, 0.1, "bonferroni")


def test_background_curve_reports_a_failed_call_and_is_reusable(tmp_path):
    # the learning curve's background process (fleet.experiment.curve.BackgroundCurve): an error in the spawned process comes
    # back as one RuntimeError naming it, and the object takes the next call
    from fleet.experiment.curve import BackgroundCurve

    with BackgroundCurve() as bg:
        assert bg.collect() == [] and not bg.pending
        bg.start({"eval": {}}, tmp_path, str(tmp_path / "registry"), [100], [])   # no "job" group: KeyError there
        assert bg.pending
        with pytest.raises(RuntimeError, match="background evaluation failed: KeyError: 'job'"):
            bg.collect()
        assert not bg.pending
        bg.start({"eval": {}}, tmp_path, str(tmp_path / "registry"), [100], [])
        with pytest.raises(RuntimeError, match="not collected yet"):
            bg.start({"eval": {}}, tmp_path, str(tmp_path / "registry"), [100], [])
    assert not bg.pending   # leaving the block stopped the pending call


def test_a_mixed_fleets_held_out_plan_keeps_each_embodiments_trials():
    """The held-out plan of a mixed fleet's tasks is, per embodiment, the plan of its tasks alone (so a mixed run's
    arms pair trial for trial with single-embodiment runs), in the given task order; one embodiment: unchanged."""
    from fleet.experiment.evaluation import evaluation_plan

    mw, so = ["reach-v3", "window-open-v3"], ["so100-reach", "so100-push-cube"]
    units = [100, 101, 102]
    key = lambda plan: [(t["task"], t["unit_id"], t["seed"], t["trial"]) for t in plan]
    mixed = evaluation_plan([mw[0], so[0], mw[1], so[1]], units, 5, seed=7)
    assert [t["task"] for t in mixed] == [mw[0]] * 5 + [so[0]] * 5 + [mw[1]] * 5 + [so[1]] * 5
    assert sorted(key(mixed)) == sorted(key(evaluation_plan(mw, units, 5, seed=7)) + key(evaluation_plan(so, units, 5, seed=7)))
    one = evaluation_plan(mw, units, 5, seed=7)   # one embodiment: g counts over every task, units round-robin
    assert [t["unit_id"] for t in one] == [units[g % 3] for g in range(10)]
    assert len({t["seed"] for t in one}) == 10


def test_a_resumed_round_takes_its_committed_retries_from_the_store(tmp_path):
    """Issue 52, item 16: the retries a stopped round committed are found in the store (its own record, by
    (retry_of, attempt) and version) and not run (committed) again; the waves and the record are as without a stop."""
    from types import SimpleNamespace

    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import committed_retries, run_retries

    spec = {"observation.state": {"shape": [4], "dtype": "float32"}, "action": {"shape": [4], "dtype": "float32"},
            "control_hz": 80.0}
    st = ExperienceStore.create_or_open(str(tmp_path / "s"), spec, progress_keys=[])
    w = st.writer("u0")

    def commit(unit, seed, success, extra=None):
        w.begin_episode(unit_id=unit, embodiment="sawyer", task="reach-v3", policy_version=3, seed=seed,
                        extra=extra or {})
        for _ in range(3):
            w.add_step({"observation.state": np.zeros(4, np.float32)}, np.zeros(4, np.float32), 0.0, {})
        return w.commit(success=success)

    fails = [{"episode_id": commit(u, 10 + u, False), "task": "reach-v3", "unit_id": u, "seed": 10 + u}
             for u in range(3)]
    # the stopped round had committed attempt 0 of the first two failures (the first recovered)
    commit(0, 10, True, {"retry_of": fails[0]["episode_id"], "attempt": 0})
    commit(1, 11, False, {"retry_of": fails[1]["episode_id"], "attempt": 0})
    w.close()
    reader = ExperienceStore.open(str(tmp_path / "s"))
    found = committed_retries(reader, version=3)
    assert set(found) == {(fails[0]["episode_id"], 0), (fails[1]["episode_id"], 0)}
    assert committed_retries(reader, version=4) == {}

    ran: list[list] = []

    class Fleet:   # records what it is asked to run; every retry it runs fails
        def run(self, plan, progress=True):
            ran.append([(t["explore"]["retry_of"], t["explore"]["attempt"]) for t in plan])
            return SimpleNamespace(episodes=[{"retry_of": t["explore"]["retry_of"], "success": False, "length": 3}
                                             for t in plan])

    cfg = {"attempts": 2, "max_share": 10.0}
    res = run_retries(Fleet(), fails, cfg, [], 3, progress=False, committed=found)
    assert ran == [[(fails[2]["episode_id"], 0)], [(fails[1]["episode_id"], 1), (fails[2]["episode_id"], 1)]]
    assert res["found"] == 2 and res["retries"] == 5 and res["recovered"] == 1
    assert [a["run"] for a in res["per_attempt"]] == [3, 2]
