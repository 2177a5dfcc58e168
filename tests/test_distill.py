"""Critic distillation and the iterative FERT round (policies/distill.py, experience_dict.sampler.MixtureDataset,
fleet.fert.learner in ``learner.round_init: published``): the critic's chosen chunks on a tiny real store, per-task
balanced replay counts, rounds that start from the published version and publish the policy with its critic, and
the deployable export acting alone (K = 1) in the vectorised runner."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from experience_dict.sampler import MixtureDataset, WindowDataset
from experience_dict.store import ExperienceStore
from fleet.fert.critic_fit import fit_critic
from fleet.fert.learner import FertLearner
from fleet.registry import CheckpointRegistry
from policies.critic import CRITIC_FILES, CriticGuidedSampler
from policies.distill import ChunkTargets, balanced_anchors, critic_targets
from policies.factory import load_policy
from tests.test_learner import OBS_CFG, ROBOT_CFG, TASK_CFG, learner_cfg, setup  # noqa: F401  (fixture)

torch.set_num_threads(1)
KEYS = ["observation.state", "observation.environment_state"]


def _critic(reader, policy, updates=30):
    critic, _ = fit_critic(reader, reader.episodes(), KEYS, policy.config.action_dim, policy.config.n_action_steps,
                           steps_after_success=5, cfg={"updates": updates, "members": 2, "hidden": 16,
                                                       "batch_size": 64, "dropout": 0.0}, seed=0)
    return critic


def test_critic_targets_are_the_best_ranked_of_the_policys_own_samples(setup):  # noqa: F811 (the fixture)
    reader = ExperienceStore.open(setup["store"])
    policy = load_policy(setup["base"]).eval()
    critic = _critic(reader, policy)
    windows = WindowDataset(reader, reader.episodes(), windows=policy.window_spec())
    anchors = balanced_anchors(windows, 12, seed=0)
    assert len(anchors) == 12 and anchors == sorted(set(anchors))          # one task: 12 distinct states
    targets, rec = critic_targets(policy, critic, windows, anchors, candidates=4, seed=3, batch_size=5)
    H, A = policy.config.horizon, policy.config.action_dim
    assert len(targets) == 12 and targets.tensors["action"].shape == (12, H, A)
    assert rec["states"] == 12 and rec["per_task"] == {"reach-v3": 12} and rec["q_chosen"] >= rec["q_own"]
    # everything but the target is the stored window; the future frames (the stored actions' outcome) are padding
    ref = windows.fetch(anchors)
    for k in ("observation.state", "history.action", "history.action_is_pad"):
        torch.testing.assert_close(targets.tensors[k], ref[k])
    assert not torch.equal(targets.tensors["action"], ref["action"].float())
    assert all(bool(v.all()) for k, v in targets.tensors.items() if k.startswith("future.") and k.endswith("_is_pad"))
    assert not targets.tensors["action_is_pad"].any()
    # the target is the candidate the critic ranks highest among K samples of the policy itself: re-sample the
    # first batch with the same noise and check that no candidate scores above the chosen chunk
    first = {k: v[:5] for k, v in ref.items() if k in policy.inference_window_spec() or
             (k.endswith("_is_pad") and k[:-7] in policy.inference_window_spec())}
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([3, 0]).generate_state(1)[0]))
    sampler = CriticGuidedSampler(policy, critic, 4)
    again = sampler(first, noise=torch.randn(5, H, A, generator=g))
    torch.testing.assert_close(again, targets.tensors["action"][:5])
    q = sampler.last_scores
    st = torch.cat([first[k].float() for k in KEYS], -1)
    chosen_q = critic.success_probability(st[:, -1], st[:, -2], again)
    torch.testing.assert_close(chosen_q, q.max(1).values, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="candidates"):
        critic_targets(policy, critic, windows, anchors, candidates=1)


def test_mixture_balances_replay_per_task_and_collates_across_parts():
    def part(task, n, value):
        return ChunkTargets({"action": torch.full((n, 4, 2), float(value)), "action_is_pad": torch.zeros(n, 4, dtype=torch.bool),
                             "extra": torch.zeros(n)}, [task] * n)

    big, small, other = part("push", 200, 1.0), part("reach", 10, 2.0), part("reach", 30, 3.0)
    ds = MixtureDataset([("replay:push", big, 0.25), ("replay:reach", small, 0.25), ("distill", other, 0.5),
                         ("empty", None, 0.3)], keys=["action", "action_is_pad"], size=400, seed=0)
    assert ds.slots == {"replay:push": 100, "replay:reach": 100, "distill": 200} and len(ds) == 400
    # the small task's windows are tiled: every one of its 10 windows appears 10 times
    reach = ds.item_of[ds.part_of == 1]
    assert sorted(np.bincount(reach, minlength=10).tolist()) == [10] * 10
    b = ds.fetch(list(range(0, 400, 7)))
    assert set(b) == {"action", "action_is_pad", "sample_weight"} and b["action"].shape[0] == len(range(0, 400, 7))
    assert set(torch.unique(b["action"]).tolist()) <= {1.0, 2.0, 3.0} and bool((b["sample_weight"] == 1).all())
    counts = {v: int((b["action"][:, 0, 0] == v).sum()) for v in (1.0, 2.0, 3.0)}
    assert counts[3.0] > counts[1.0] and counts[3.0] > counts[2.0]
    with pytest.raises(ValueError, match="no part"):
        MixtureDataset([("a", big, 0.0)], keys=["action"], size=10)


def _validator(calls):
    def validate(candidates, r, policy_alone=False):
        calls.append({"candidates": dict(candidates), "round": r, "policy_alone": policy_alone})
        return "finetuned", {"accepted": True}
    return validate


def test_iterative_rounds_start_from_the_published_version_and_distil_the_critic(setup, tmp_path):  # noqa: F811 (the fixture)
    reg_url = str(tmp_path / "registry")
    CheckpointRegistry(reg_url).publish(setup["base"], metadata={"run_id": "base", "round": -1})
    cfg = learner_cfg(4)
    cfg["task"] = TASK_CFG
    cfg["learner"] |= {"round_init": "published", "wise_alpha": 0.5}
    cfg["fert"] |= {"critic": {"enabled": True, "updates": 10, "members": 2, "hidden": 16, "candidates": 3},
                    "distill": {"enabled": True, "states_per_task": 16, "batch_size": 8},
                    "mix": {"retrieved": 0.25, "distill": 0.5, "replay": 0.25}}
    calls = []
    lrn = FertLearner(cfg, setup["store"], reg_url, str(tmp_path / "work"), setup["base"], run_id="fert",
                      validator=_validator(calls))
    status = lrn.run(rounds=2)
    reg = CheckpointRegistry(reg_url)
    assert status["published"] == [2, 3] and reg.latest_version() == 3
    h0, h1 = status["history"]
    assert h0["mix"]["distill"]["states"] == 16 and h0["mix"]["distill"]["candidates"] == 3
    assert set(h0["mix"]["slots"]) == {"retrieved", "distill", "replay:reach-v3"}
    assert h0["mix"]["slots"]["distill"] == 32 and sum(h0["mix"]["slots"].values()) == 64   # 4 updates x batch 16
    # round 1 started from what round 0 published (the registry's v2), not from the base
    assert "v000002" in h1["init"] and h0["init"] != h1["init"]
    assert set(h1["times"]) >= {"critic_s", "distill_s", "train_s", "validation_s"}
    # each round counts its new fleet action groups outside the tokenizer's fitted range (round 1: none new)
    assert h0["tokenizer_range"]["episodes"] > 0 and h0["tokenizer_range"]["groups"] > 0
    assert h1["tokenizer_range"]["episodes"] == 0
    # the gate compared the weights alone; the published version carries the round's critic
    assert [c["policy_alone"] for c in calls] == [True, True]
    assert not any((Path(calls[0]["candidates"]["finetuned"]) / f).exists() for f in CRITIC_FILES)
    v3 = reg.fetch(3, tmp_path / "v3")
    assert all((Path(v3) / f).is_file() for f in CRITIC_FILES)
    assert lrn.final_checkpoint() == h1["checkpoint"]


def test_critic_fitted_in_its_own_process_gives_the_same_round(setup, tmp_path):  # noqa: F811 (the fixture)
    # fert.critic.fit_process: the critic is fitted in a spawned process while the learner samples the distillation's
    # candidates; the critic, the critic targets and the round's weights are those of the in-process round
    from policies.critic import CRITIC_WEIGHTS

    out = {}
    for mode in (True, False):
        reg_url = str(tmp_path / f"registry_{mode}")
        CheckpointRegistry(reg_url).publish(setup["base"], metadata={"run_id": "base", "round": -1})
        cfg = learner_cfg(3)
        cfg["task"] = TASK_CFG
        cfg["learner"] |= {"round_init": "published"}
        cfg["fert"] |= {"critic": {"enabled": True, "updates": 8, "members": 2, "hidden": 16, "candidates": 3,
                                   "fit_process": mode},
                        "distill": {"enabled": True, "states_per_task": 12, "batch_size": 5},
                        "mix": {"retrieved": 0.25, "distill": 0.5, "replay": 0.25}}
        lrn = FertLearner(cfg, setup["store"], reg_url, str(tmp_path / f"work_{mode}"), setup["base"], run_id="fert",
                          validator=_validator([]))
        out[mode] = lrn.run_round()
    proc, here = out[True], out[False]
    assert "candidates_s" in proc["times"] and "wait_s" in proc["critic"] and "wait_s" not in here["critic"]
    assert proc["critic"]["val_loss"] == here["critic"]["val_loss"] and proc["mix"]["distill"] == here["mix"]["distill"]
    for f in ("model.safetensors", CRITIC_WEIGHTS):
        assert (Path(proc["checkpoint"]) / f).read_bytes() == (Path(here["checkpoint"]) / f).read_bytes()


def test_a_rejected_round_publishes_the_current_weights_with_the_new_critic(setup, tmp_path):  # noqa: F811 (the fixture)
    reg_url = str(tmp_path / "registry")
    CheckpointRegistry(reg_url).publish(setup["base"], metadata={"run_id": "base", "round": -1})
    cfg = learner_cfg(2)
    cfg["task"] = TASK_CFG
    cfg["learner"] |= {"round_init": "published"}
    cfg["fert"] |= {"critic": {"enabled": True, "updates": 5, "members": 2, "hidden": 16, "candidates": 2},
                    "distill": {"enabled": False}}
    lrn = FertLearner(cfg, setup["store"], reg_url, str(tmp_path / "work"), setup["base"], run_id="fert",
                      validator=lambda c, r, policy_alone=False: (None, {"accepted": False}))
    rec = lrn.run_round()
    assert rec["published_candidate"] == "critic_only" and rec["version"] == 2 and "distill" not in rec["mix"]
    v2 = Path(CheckpointRegistry(reg_url).fetch(2, tmp_path / "v2"))
    base = Path(setup["base"])
    assert (v2 / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    assert all((v2 / f).is_file() for f in CRITIC_FILES)
    assert lrn.state["rejected"] == [0]


def test_after_a_rejection_the_lineage_goes_on_from_the_rejected_weights(setup, tmp_path):  # noqa: F811 (the fixture)
    # learner.after_reject: candidate: round 1 starts from round 0's rejected weights, while the fleet keeps the
    # base's weights (published with round 0's critic) and round 1 is gated against them
    reg_url = str(tmp_path / "registry")
    CheckpointRegistry(reg_url).publish(setup["base"], metadata={"run_id": "base", "round": -1})
    cfg = learner_cfg(2)
    cfg["task"] = TASK_CFG
    cfg["learner"] |= {"round_init": "published", "after_reject": "candidate"}
    cfg["fert"] |= {"critic": {"enabled": True, "updates": 5, "members": 2, "hidden": 16, "candidates": 2},
                    "distill": {"enabled": False}}
    verdicts = iter([None, "finetuned"])
    lrn = FertLearner(cfg, setup["store"], reg_url, str(tmp_path / "work"), setup["base"], run_id="fert",
                      validator=lambda c, r, policy_alone=False: (next(verdicts), {}))
    h0, h1 = lrn.run_round(), lrn.run_round()
    base = (Path(setup["base"]) / "model.safetensors").read_bytes()
    v2 = Path(CheckpointRegistry(reg_url).fetch(2, tmp_path / "v2"))
    assert h0["published_candidate"] == "critic_only" and (v2 / "model.safetensors").read_bytes() == base
    assert h1["init"] == h0["checkpoint"] and h1["version"] == 3
    v3 = Path(CheckpointRegistry(reg_url).fetch(3, tmp_path / "v3"))
    assert (v3 / "model.safetensors").read_bytes() == (Path(h1["checkpoint"]) / "model.safetensors").read_bytes()
    cfg["learner"]["after_reject"] = "newest"
    with pytest.raises(ValueError, match="learner.after_reject"):
        FertLearner(cfg, setup["store"], reg_url, str(tmp_path / "w2"), setup["base"], run_id="x").round_init_checkpoint()


def test_the_export_acts_alone_through_its_onnx_graph_like_the_checkpoint(setup, tmp_path):  # noqa: F811 (the fixture)
    """The deployable artifact (scripts/export.py with an ONNX chunk graph) in the vectorised runner: it runs the
    graph at batch 1, and its actions are the checkpoint's own (same trials, same seeded noise)."""
    from fleet.experiment.evaluation import evaluation_plan, load_acting_policy, run_plan_vectorised
    from policies.export import export_checkpoint

    exp = export_checkpoint(setup["base"], tmp_path / "export", onnx_steps=[10])
    policy, _, graph_batch = load_acting_policy(exp)
    assert graph_batch == 1 and policy.chunk_sampler is not None       # chunks come from ONNX Runtime
    cfg = {"robot": ROBOT_CFG, "obs": OBS_CFG, "task": {**TASK_CFG, "max_episode_steps": 12}, "store": {}}
    plan = evaluation_plan(["reach-v3"], [100], 2, seed=5)
    a = run_plan_vectorised(cfg, setup["base"], plan, tmp_path / "torch", batch_size=2)
    b = run_plan_vectorised(cfg, str(exp), plan, tmp_path / "onnx", batch_size=2)
    assert [e["seed"] for e in a] == [e["seed"] for e in b] and all(e["length"] == 12 for e in b)
    ra, rb = ExperienceStore.open(tmp_path / "torch"), ExperienceStore.open(tmp_path / "onnx")
    for ea, eb in zip(a, b):
        np.testing.assert_allclose(rb.load_episode(eb["episode_id"], keys=["action"])["action"],
                                   ra.load_episode(ea["episode_id"], keys=["action"])["action"], atol=2e-3)
    assert json.loads((exp / "export.json").read_text())["onnx"][0]["batch_size"] == 1


def test_round_init_base_starts_every_round_from_the_initial_weights(setup, tmp_path):  # noqa: F811 (the fixture)
    # learner.round_init: base: every round (critic, gate, publishing as in published mode) starts from the loop's
    # initial weights on the whole store, not from the version the previous round published
    reg_url = str(tmp_path / "registry")
    CheckpointRegistry(reg_url).publish(setup["base"], metadata={"run_id": "base", "round": -1})
    cfg = learner_cfg(2)
    cfg["task"] = TASK_CFG
    cfg["learner"] |= {"round_init": "base"}
    cfg["fert"] |= {"critic": {"enabled": True, "updates": 5, "members": 2, "hidden": 16, "candidates": 2},
                    "distill": {"enabled": False}}
    lrn = FertLearner(cfg, setup["store"], reg_url, str(tmp_path / "work"), setup["base"], run_id="fert",
                      validator=lambda c, r, policy_alone=False: ("finetuned", {"accepted": True}))
    assert lrn.iterative
    h0, h1 = lrn.run_round(), lrn.run_round()
    assert h0["init"] == h1["init"] == setup["base"] and (h0["version"], h1["version"]) == (2, 3)
    v3 = Path(CheckpointRegistry(reg_url).fetch(3, tmp_path / "v3"))
    assert (v3 / "model.safetensors").read_bytes() == (Path(h1["checkpoint"]) / "model.safetensors").read_bytes()
    assert all((v3 / f).is_file() for f in CRITIC_FILES)
