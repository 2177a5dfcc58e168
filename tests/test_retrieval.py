"""FERT retrieval on a real Zarr store: failure onsets in metadata, same-task successful windows only, never a
failed episode or a held-out unit, incremental refresh, the replay mix of FERT batches, task priority."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from experience_dict.store import DEFAULT_PROGRESS_KEYS, ExperienceStore
from fleet.fert.config import FertConfig
from fleet.fert.contexts import embed_contexts, failure_contexts
from fleet.fert.data import FertData
from fleet.fert.dataset import FertBatchSampler, FertDataset
from fleet.fert.failure import annotate_failures
from fleet.fert.index import SuccessIndex
from fleet.fert.keys import STATE_KEYS, ContextEmbedder, policy_encoder
from fleet.fert.priority import TaskPriority
from fleet.fert.retrieve import retrieve

torch.set_num_threads(1)
SPEC = {"observation.state": {"shape": [4], "dtype": "float32"},
        "observation.environment_state": {"shape": [7], "dtype": "float32"},
        "action": {"shape": [4], "dtype": "float32"}, "control_hz": 80.0}
T, L, W = 40, 30, 6            # episode length, steps to reach the goal, context window
HELDOUT = 100
# the repo's FERT config with small-test overrides
FERT_CFG = OmegaConf.merge(OmegaConf.structured(FertConfig),
                           {"window": W, "top_k": 4, "replay_ratio": 0.25, "include_demos": False,
                            "key": "absolute", "gate": {"enabled": False}})   # the 7-d test layout: absolute key


def trajectory(start, goal, stall: int | None = None, flat: bool = False):
    """Hand moves linearly from start to goal in L steps (stops at ``stall``); object rides with the hand."""
    start, goal = np.asarray(start, np.float64), np.asarray(goal, np.float64)
    frac = np.minimum(np.arange(T) / L, 1.0)
    if stall is not None:
        frac = np.minimum(frac, frac[stall - 1])
    pos = start + frac[:, None] * (goal - start)                                    # (T, 3)
    d = np.linalg.norm(pos - goal, axis=1)
    steps = []
    for t in range(T):
        obs = {"observation.state": np.r_[pos[t], 0.5].astype(np.float32),
               "observation.environment_state": np.r_[pos[t], goal, 0.0].astype(np.float32)}
        act = np.r_[np.clip((goal - start) / L * 100, -1, 1), 0.0].astype(np.float32) * (frac[t] < 1)
        ipr = 0.3 if flat else 1.0 - d[t] / d[0]
        prog = {k: 0.0 for k in DEFAULT_PROGRESS_KEYS}
        prog.update(in_place_reward=ipr, obj_to_target=d[0] if flat else d[t], unscaled_reward=10 * ipr)
        steps.append((obs, act.astype(np.float32), 10 * ipr, prog))
    return steps


def write(w, unit, task, steps, success, is_demo=False, version=0):
    w.begin_episode(unit_id=unit, embodiment="sawyer", task=task, policy_version=version, seed=0, is_demo=is_demo)
    for obs, act, r, prog in steps:
        w.add_step(obs, act, r, prog)
    return w.commit(success=success)


def build_store(url):
    """Families (start, goal) of one task: a success on one unit, a stalled failure on another; a held-out
    success duplicating a failure; a success of another task duplicating a failure; demonstrations."""
    store = ExperienceStore.create_or_open(url, spec=SPEC)
    rng = np.random.default_rng(0)
    ids = {"success": {}, "failure": {}, "family_success": {}, "stall": {}}
    writers = {u: store.writer(f"unit-{u:04d}") for u in (0, 1, 2, HELDOUT)}
    for task in ("push-v3", "reach-v3"):
        for f in range(4):
            start, goal = rng.uniform(-0.3, 0.3, 3), rng.uniform(-0.3, 0.3, 3)
            su, fu = f % 3, (f + 1) % 3
            s_id = write(writers[su], su, task, trajectory(start, goal), True)
            stall = 12 + 3 * f
            f_id = write(writers[fu], fu, task, trajectory(start, goal, stall=stall), False, version=1)
            ids["success"][s_id], ids["failure"][f_id] = task, task
            ids["family_success"][f_id], ids["stall"][f_id] = s_id, stall
            if task == "push-v3" and f == 0:
                # exact duplicates of this failure's trajectory: a held-out success and a reach-v3 success
                ids["heldout"] = write(writers[HELDOUT], HELDOUT, task, trajectory(start, goal), True)
                ids["other_task"] = write(writers[2], 2, "reach-v3", trajectory(start, goal), True)
                ids["success"][ids["other_task"]] = "reach-v3"
                # a second, near-identical failure (would be the top hit if failures were indexed)
                dup = write(writers[2], 2, task, trajectory(start + 1e-4, goal, stall=stall), False, version=1)
                ids["failure"][dup] = task
                ids["family_success"][dup], ids["stall"][dup] = s_id, stall
    for task in ("push-v3", "reach-v3"):
        for _ in range(2):
            ids.setdefault("demo", []).append(
                write(writers[0], 0, task, trajectory(rng.uniform(-.3, .3, 3), rng.uniform(-.3, .3, 3)), True,
                      is_demo=True, version=-1))
    ids["flat"] = write(writers[1], 1, "push-v3", trajectory([0, 0, 0], [0.2, 0, 0], stall=10, flat=True), False)
    for w in writers.values():
        w.close()
    return store, ids


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("store") / "store")
    _, ids = build_store(url)
    return url, ids


def test_failure_onsets_are_written_to_the_store(world):
    url, ids = world
    reader = ExperienceStore.open(url)
    out = annotate_failures(reader, W, tolerance=0.02)
    assert set(out) == set(ids["failure"]) | {ids["flat"]}
    for ep, stall in ids["stall"].items():
        # linear progress (1/L per step > tolerance) up to the stall, flat after: onset = last moving step
        assert out[ep] == (stall - 1, "progress")
    assert out[ids["flat"]] == (T - 1, "fallback")                 # constant signals: last W steps
    fresh = ExperienceStore.open(url)                               # the annotation is in the store
    assert fresh.episode(ids["flat"]).failure_onset == T - 1
    assert {e: fresh.episode(e).failure_onset for e in ids["stall"]} == {e: s - 1 for e, s in ids["stall"].items()}
    assert annotate_failures(fresh, W) == {}                        # nothing left to annotate


def test_learners_with_other_onset_settings_keep_their_own_onsets_on_one_store(tmp_path):
    """Two learners on one store, one without progress signals (the deployed preset: every onset the last step)
    and one with them (the analysis arm ``fert_sim_progress``): whichever annotates the store first, each retrieves
    from its own onsets."""
    url = str(tmp_path / "store")
    _, ids = build_store(url)
    reader = ExperienceStore.open(url)
    stats = reader.stats(list(STATE_KEYS))
    blind = FertData(reader, OmegaConf.merge(FERT_CFG, {"onset": {"progress": False}}), stats=stats,
                     exclude_units=[HELDOUT])
    blind.update()   # first: the store's onsets are its (the last step)
    assert {reader.episode(e).failure_onset for e in ids["stall"]} == {T - 1}
    other = ExperienceStore.open(url)
    seeing = FertData(other, FERT_CFG, stats=stats, exclude_units=[HELDOUT])
    seeing.update()
    assert {e: seeing.onsets[e] for e in ids["stall"]} == {e: (s - 1, "progress") for e, s in ids["stall"].items()}
    got = {c.episode_id: c.onset for c in seeing.retrieve().contexts if c.episode_id in ids["stall"]}
    assert got == {e: s - 1 for e, s in ids["stall"].items()}
    assert {c.onset for c in blind.retrieve().contexts if c.episode_id in ids["stall"]} == {T - 1}


def test_retrieval_same_task_successes_only(world):
    url, ids = world
    reader = ExperienceStore.open(url)
    fert = FertData(reader, FERT_CFG, stats=reader.stats(list(STATE_KEYS)), exclude_units=[HELDOUT])
    counts = fert.update()
    assert counts["indexed"] == len(ids["success"])                 # held-out, failures and demos left out
    assert ids["heldout"] not in fert.index and not any(e in fert.index for e in ids["failure"])
    ret = fert.retrieve()
    assert {c.episode_id for c in ret.contexts} == set(ids["failure"]) | {ids["flat"]}
    assert len(ret) == len(ret.contexts) * FERT_CFG["top_k"]
    for i in range(len(ret)):
        ctx, ep = ret.contexts[ret.context[i]], ret.episode_id[i]
        meta = reader.episode(ep)
        assert meta.success and not meta.is_demo and meta.unit_id != HELDOUT
        assert meta.task == ctx.task == ret.source_task[i]
        assert ep not in ids["failure"] and ep != ids["heldout"]
    assert ids["other_task"] not in [e for e, c in zip(ret.episode_id, ret.context)
                                     if ret.contexts[c].task == "push-v3"]
    # the failure's own trajectory up to the onset exists in its family's success: top-1, same step, sim ~1
    for c, ctx in enumerate(ret.contexts):
        if ctx.episode_id not in ids["stall"]:
            continue
        rows = np.flatnonzero(ret.context == c)
        top = rows[np.argmax(ret.similarity[rows])]
        assert ret.episode_id[top] in (ids["family_success"][ctx.episode_id], ids["other_task"])
        assert ret.episode_id[top] == ids["family_success"][ctx.episode_id]
        assert ret.step[top] == ctx.onset and ret.similarity[top] > 0.999
    np.testing.assert_allclose(ret.weight.sum(), 1.0)
    assert np.all(ret.weight > 0)
    rec = json.loads(json.dumps(ret.to_json()))
    assert len(rec["entries"]) == len(ret) and rec["contexts"][0]["episode_id"] == ret.contexts[0].episode_id
    restored = FertData(reader, FERT_CFG, stats=reader.stats(list(STATE_KEYS)), exclude_units=[HELDOUT])
    restored.load_state_dict(json.loads(json.dumps(fert.state_dict())))
    assert restored.priority.success_rate("push-v3") == fert.priority.success_rate("push-v3") < 0.5


def test_index_refreshes_incrementally(tmp_path):
    url = str(tmp_path / "store")
    store = ExperienceStore.create_or_open(url, spec=SPEC)
    w = store.writer("unit-0000")
    a = write(w, 0, "push-v3", trajectory([0, 0, 0], [0.2, 0.1, 0.0]), True)
    reader = ExperienceStore.open(url)
    emb = ContextEmbedder(reader.stats(list(STATE_KEYS)), frames=W)
    index = SuccessIndex(emb, stride=2)
    assert index.refresh(reader) == 1 and index.size("push-v3") == T // 2
    b = write(w, 0, "push-v3", trajectory([0.1, 0, 0], [-0.2, 0.1, 0.1]), True)
    fail = write(w, 0, "push-v3", trajectory([0.1, 0, 0], [-0.2, 0.1, 0.1], stall=8), False)
    assert index.refresh(reader) == 0                               # snapshot: not visible before refresh()
    reader.refresh()
    assert index.refresh(reader) == 1 and index.refresh(reader) == 0
    assert a in index and b in index and fail not in index
    with pytest.raises(ValueError, match="only successful"):
        index.add_episode(reader.episode(fail), reader.load_episode(fail, list(STATE_KEYS)))
    hits = index.search("push-v3", emb.embed_episode(reader.load_episode(b, list(STATE_KEYS)), np.array([10])), 3)[0]
    assert hits[0].episode_id == b and hits[0].step == 10 and hits[0].similarity == pytest.approx(1.0, abs=1e-5)
    assert index.search("reach-v3", np.zeros((2, index.tasks["push-v3"].index.d), np.float32), 3) == [[], []]
    w.close()


def test_fert_batches_have_the_replay_mix(world):
    url, _ = world
    reader = ExperienceStore.open(url)
    fert = FertData(reader, {**FERT_CFG, "replay_all": False, "segment_steps": 1}, stats=reader.stats(list(STATE_KEYS)),
                    exclude_units=[HELDOUT])
    fert.update()
    ret = fert.retrieve()
    demos = reader.episodes(is_demo=True)
    windows = {"observation.state": ("observation.state", [-1, 0]), "action": ("action", list(range(4)))}
    ds = fert.dataset(ret, demos, windows, seed=0)
    r = FERT_CFG["replay_ratio"]
    assert ds.n_retrieved == len(ret) and ds.n_replay == round(len(ret) * r / (1 - r))
    flags = np.array([bool(ds[i]["fert.is_replay"]) for i in range(len(ds))])
    assert flags.sum() == ds.n_replay and abs(flags.mean() - r) < 0.01
    # retrieved items are the store's windows at the retrieved anchors; loss weights average 1
    for i in (0, 7, ds.n_retrieved - 1):
        item = ds[i]
        data = reader.load_episode(ret.episode_id[i], ["action", "observation.state"])
        s = int(ret.step[i])
        assert item["step"] == s and item["task"] == ret.source_task[i]
        np.testing.assert_array_equal(item["action"].numpy(), data["action"][np.clip(np.arange(s, s + 4), 0, T - 1)])
        np.testing.assert_array_equal(item["observation.state"][1].numpy(), data["observation.state"][s])
    sw = np.array([float(ds[i]["sample_weight"]) for i in range(ds.n_retrieved)])
    assert sw.mean() == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_allclose(sw, ret.weight / ret.weight.sum() * len(ret), rtol=1e-5)
    demo_ids = {e.episode_id for e in demos}
    for i in range(ds.n_retrieved, len(ds), 5):
        item = ds[i]
        assert ds.replay.episodes[item["episode_index"]].episode_id in demo_ids and float(item["sample_weight"]) == 1.0
    # a plain shuffled DataLoader collates the mixed items (what train_policy does)
    batch = next(iter(DataLoader(ds, batch_size=16, shuffle=True)))
    assert batch["action"].shape == (16, 4, 4) and batch["sample_weight"].shape == (16,)
    # the batch sampler: exact mix in every batch, deterministic per (seed, batch index)
    sampler = FertBatchSampler(ds, batch_size=8, num_batches=5, seed=3)
    batches = list(sampler)
    assert len(batches) == 5 and all(sum(i >= ds.n_retrieved for i in b) == 2 for b in batches)
    assert list(FertBatchSampler(ds, 8, 5, seed=3, start=2)) == batches[2:]
    # replay only when nothing was retrieved; sample weighting draws entries, weights 1
    ds0 = FertDataset(reader, retrieve(fert.index, np.zeros((0, 1), np.float32), [], None), demos, windows)
    assert ds0.n_retrieved == 0 and len(ds0) == sum(e.length for e in demos)
    ds_s = FertDataset(reader, ret, demos, windows, replay_ratio=0.5, weighting="sample", seed=1)
    assert ds_s.n_replay == ds_s.n_retrieved == len(ret)
    assert all(float(ds_s[i]["sample_weight"]) == 1.0 for i in range(0, ds_s.n_retrieved, 9))
    with pytest.raises(ValueError, match="replay_ratio"):
        FertDataset(reader, ret, demos, windows, replay_ratio=1.5)
    # replay_all: every demonstration window is replayed once per epoch, still at the stated ratio
    n_demo_windows = sum(e.length for e in demos)
    ds_all = FertDataset(reader, ret, demos, windows, replay_ratio=0.25, replay_all=True)
    assert ds_all.n_replay >= n_demo_windows and ds_all.n_retrieved % len(ret) == 0
    assert sorted(set(ds_all._rep_index.tolist())) == list(range(n_demo_windows))
    assert abs(ds_all.n_replay / len(ds_all) - 0.25) < 0.01
    sw_all = np.array([float(ds_all[i]["sample_weight"]) for i in range(0, ds_all.n_retrieved, 7)])
    assert sw_all.mean() == pytest.approx(1.0, rel=0.2)
    # segments: each entry expands into the windows of its successful continuation, sharing its weight
    S = 5
    ds_seg = FertDataset(reader, ret, demos, windows, replay_ratio=0.5, segment_steps=S)
    lengths = [min(S, reader.episode(e).length - int(s)) for e, s in zip(ret.episode_id, ret.step)]
    assert ds_seg.n_retrieved == sum(lengths) > len(ret)
    sw_seg = np.array([float(ds_seg[i]["sample_weight"]) for i in range(ds_seg.n_retrieved)])
    assert sw_seg.mean() == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_allclose(sw_seg[:lengths[0]].sum() / ds_seg.n_retrieved, ret.weight[0] / ret.weight.sum(),
                               rtol=1e-5)
    steps = [int(ds_seg[i]["step"]) for i in range(lengths[0])]
    assert steps == list(range(int(ret.step[0]), int(ret.step[0]) + lengths[0]))
    assert all(ds_seg[i]["task"] == ret.source_task[0] for i in range(lengths[0]))
    with pytest.raises(ValueError, match="segment_steps"):
        FertDataset(reader, ret, demos, windows, segment_steps=0)
    # a batch read at once (fetch: one vectorised read per part) holds exactly the items' values
    from torch.utils.data import default_collate

    pick = [0, 3, ds_seg.n_retrieved + 2, 1, len(ds_seg) - 1]
    batch = ds_seg.fetch(pick)
    order = sorted(pick, key=lambda i: i >= ds_seg.n_retrieved)        # retrieved slots first, then replay
    ref = default_collate([ds_seg[i] for i in order])
    for k in ("observation.state", "action", "sample_weight", "fert.is_replay", "fert.similarity", "step"):
        torch.testing.assert_close(batch[k], ref[k])
    assert batch["task"] == list(ref["task"])
    with pytest.raises(IndexError):
        ds_seg.fetch([len(ds_seg)])


def test_task_priority_learnability():
    pr = TaskPriority("learnability", window=10, floor=0.0)
    for s in [True, False] * 5:
        pr.update("half", s)
    for _ in range(10):
        pr.update("solved", True)
        pr.update("never", False)
    p = dict(zip(["half", "solved", "never"], pr.probs(["half", "solved", "never"])))
    assert p["half"] > 2.5 * p["solved"] and p["solved"] == pytest.approx(p["never"])
    assert pr.success_rate("half") == 0.5 and pr.success_rate("unknown") == 0.5
    for _ in range(10):                                             # the window forgets old outcomes
        pr.update("half", True)
    assert pr.success_rate("half") == pytest.approx(11 / 12)
    restored = TaskPriority("learnability", window=10, floor=0.0)
    restored.load_state_dict(pr.state_dict())
    np.testing.assert_allclose(restored.probs(["half", "never"]), pr.probs(["half", "never"]))
    np.testing.assert_allclose(TaskPriority("uniform").probs(["a", "b"]), [0.5, 0.5])
    with pytest.raises(ValueError, match="method"):
        TaskPriority("ucb")


def test_contexts_priority_weights_and_errors(world):
    url, _ = world
    reader = ExperienceStore.open(url)
    annotate_failures(reader, W)
    ctx = failure_contexts(reader, exclude_units=[HELDOUT])
    assert ctx and all(c.unit_id != HELDOUT for c in ctx)
    emb = ContextEmbedder(reader.stats(list(STATE_KEYS)), frames=W)
    index = SuccessIndex(emb, include_demos=False, exclude_units=[HELDOUT])
    index.refresh(reader)
    q = embed_contexts(reader, emb, ctx)
    pr = TaskPriority(floor=0.0)
    for _ in range(20):
        pr.update("push-v3", True)                                   # push solved, reach half the time
        pr.update("reach-v3", bool(_ % 2))
    ret = retrieve(index, q, ctx, pr, top_k=2)
    mass = {t: ret.weight[[ret.contexts[c].task == t for c in ret.context]].sum() for t in ("push-v3", "reach-v3")}
    assert mass["reach-v3"] > 2 * mass["push-v3"]
    with pytest.raises(ValueError, match="one per context"):
        retrieve(index, q[:1], ctx)
    with pytest.raises(KeyError, match="observation.environment_state"):
        ContextEmbedder({"observation.state": {"mean": [0] * 4, "std": [1] * 4}})


def test_policy_encoder_embeddings(world):
    """Context embeddings from the AED diffusion policy's observation encoder (encoder: policy)."""
    from policies.aed_diffusion import AEDDiffusionConfig, AEDDiffusionPolicy
    url, ids = world
    reader = ExperienceStore.open(url)
    cfg = AEDDiffusionConfig(input_shapes={"observation.state": [4], "observation.environment_state": [7]},
                             dim=32, n_layers=1, n_heads=2, state_hidden=32, aed={"enabled": False},
                             mt_loss={"weight": 0.0})
    policy = AEDDiffusionPolicy(cfg, reader.stats(list(STATE_KEYS) + ["action"])).eval()
    fert = FertData(reader, OmegaConf.merge(FERT_CFG, {"encoder": "policy", "pool": "flatten"}),
                    exclude_units=[HELDOUT], encoder=policy_encoder(policy, pool="flatten"))
    fert.update()
    ret = fert.retrieve()
    assert ret.query.shape == (len(ret.contexts), W * 32)
    np.testing.assert_allclose(np.linalg.norm(ret.query, axis=1), 1.0, rtol=1e-5)
    for c, ctx in enumerate(ret.contexts):        # identical state windows give identical encoder features
        if ctx.episode_id in ids["stall"]:
            rows = np.flatnonzero(ret.context == c)
            top = rows[np.argmax(ret.similarity[rows])]
            assert ret.episode_id[top] == ids["family_success"][ctx.episode_id] and ret.step[top] == ctx.onset
    assert all(reader.episode(e).success for e in ret.episode_id)
    with pytest.raises(ValueError, match="needs encoder"):
        FertData(reader, OmegaConf.merge(FERT_CFG, {"encoder": "policy"}))
    with pytest.raises(ValueError, match="unknown keys"):
        FertData(reader, {"window": 4, "topk": 3})


def test_fert_data_defaults_are_the_fert_config(monkeypatch):
    """A key missing from ``cfg`` takes FertConfig's value (the typed ``fert`` group every run composes)."""
    from fleet.fert import data, keys

    yaml = FertConfig().to_dict()
    fert = FertData(None, {"window": 4})
    assert yaml["key"] == "relative" and isinstance(fert.embedder, keys.RelativeEmbedder)
    assert yaml["gate"]["enabled"] is True and fert.gate is not None
    seen = {}
    monkeypatch.setattr(data, "FertDataset", lambda *a, **kw: seen.update(kw))
    fert.dataset(None, [], {})
    assert (seen["replay_ratio"], seen["segment_steps"]) == (yaml["replay_ratio"], yaml["segment_steps"]) == (0.25, 16)


def test_context_confidence_moves_far_contexts_mass_to_replay(world):
    """``fert.confidence_scale_m``: a context's weight shrinks with its neighbours' mean key distance as
    exp(-d^2 / 2 sigma^2), unnormalised; the retrieved windows' loss weights shrink by the lost mass."""
    url, _ = world
    reader = ExperienceStore.open(url)
    stats = reader.stats(list(STATE_KEYS))
    plain = FertData(reader, FERT_CFG, stats=stats, exclude_units=[HELDOUT])
    plain.update()
    ref = plain.retrieve()
    sigma = 0.05
    conf = FertData(reader, {**FERT_CFG, "confidence_scale_m": sigma}, stats=stats, exclude_units=[HELDOUT])
    conf.update()
    ret = conf.retrieve()
    assert ret.episode_id == ref.episode_id                         # same neighbours, only the weights change
    for c in range(len(ret.contexts)):
        rows = np.flatnonzero(ret.context == c)
        if not len(rows):
            continue
        d = ret.distance[rows].astype(np.float64).mean()
        expect = ref.context_weight[c] * np.exp(-d ** 2 / (2 * sigma ** 2))
        assert ret.context_weight[c] == pytest.approx(expect, rel=1e-5)
        np.testing.assert_allclose(ret.weight[rows].sum(), expect, rtol=1e-5)
    mass = ret.weight.sum()
    assert 0.0 < mass < 0.999                                       # some contexts' neighbours are not exact
    assert ret.context_weight.max() == pytest.approx(ref.context_weight.max(), rel=0.05)   # exact hits keep theirs
    windows = {"observation.state": ("observation.state", [-1, 0]), "action": ("action", list(range(4)))}
    ds = conf.dataset(ret, reader.episodes(is_demo=True), windows, seed=0)
    sw = np.array([float(ds[i]["sample_weight"]) for i in range(ds.n_retrieved)])
    assert sw.mean() == pytest.approx(mass, rel=1e-4)              # replay windows keep weight 1
    with pytest.raises(ValueError, match="confidence_scale"):
        retrieve(conf.index, np.zeros((0, 1), np.float32), [], None, confidence_scale=0.0)


def test_index_switches_to_ivf_above_the_threshold_and_keeps_recall(world):
    """Above ``approx_above`` windows a task's index becomes an IVF index (trained once, then added to
    incrementally); its neighbours match exact search (recall@k measured against it) and the audit says so."""
    from fleet.fert.audit import retrieval_audit

    url, ids = world
    reader = ExperienceStore.open(url)
    stats = reader.stats(list(STATE_KEYS))
    exact = FertData(reader, {**FERT_CFG, "approx_above": None}, stats=stats, exclude_units=[HELDOUT])
    exact.update()
    approx = FertData(reader, {**FERT_CFG, "approx_above": 64, "nprobe": 64}, stats=stats, exclude_units=[HELDOUT])
    approx.update()
    for task in ("push-v3", "reach-v3"):
        assert approx.index.tasks[task].approx and not exact.index.tasks[task].approx
        assert approx.index.size(task) == exact.index.size(task)
        np.testing.assert_array_equal(approx.index.task_vectors(task), exact.index.task_vectors(task))
    ra, re_ = approx.retrieve(), exact.retrieve()
    assert ra.episode_id == re_.episode_id and np.array_equal(ra.step, re_.step)   # nprobe = every list: exact
    q = ra.query[[i for i, c in enumerate(ra.contexts) if c.task == "push-v3"]]
    assert approx.index.recall("push-v3", q, 4) == 1.0
    approx.index.tasks["push-v3"].index.nprobe = 1                                   # probing one list of many
    assert 0.0 < approx.index.recall("push-v3", q, 4) <= 1.0
    audit = retrieval_audit(ra, approx.index)
    assert audit["per_task"]["reach-v3"]["index"]["kind"] == "ivf"
    assert retrieval_audit(re_, exact.index)["per_task"]["reach-v3"]["index"] == {
        "kind": "exact", "windows": exact.index.size("reach-v3"), "recall_at_8": 1.0}
    n0 = approx.index.size("push-v3")                                                # incremental adds, no retrain
    meta = reader.episode(next(iter(ids["success"])))
    approx.index.windows_of.pop(meta.episode_id)
    approx.index._pos.pop(meta.episode_id)
    approx.index.add_episode(meta, reader.load_episode(meta.episode_id, keys=list(STATE_KEYS)))
    assert approx.index.size(meta.task) == (n0 if meta.task == "push-v3" else exact.index.size(meta.task)) + meta.length
    with pytest.raises(ValueError, match="approx_above"):
        SuccessIndex(approx.embedder, approx_above=10)


class _Episodes:
    """A reader's ``episodes()`` over given metadata (the store's own filter semantics for the keys used)."""

    def __init__(self, metas):
        self.metas = metas

    def episodes(self, success=None, is_demo=None, **_):
        return [m for m in self.metas if (success is None or m.success == success)
                and (is_demo is None or m.is_demo == is_demo)]


def test_task_priority_and_failure_contexts_do_not_follow_the_wall_clock():
    """Two runs of one seed commit the same episodes, but the units race, so the wall-clock start times order
    them differently: the task priority and the failure contexts (which are kept, in which order) must be the
    same (they followed ``start_time`` before, and the round's training data differed between runs)."""
    from experience_dict.store.schema import EpisodeMeta
    from fleet.fert.contexts import commit_order, failure_contexts
    from fleet.fert.priority import TaskPriority

    rng = np.random.default_rng(0)
    metas = []
    for u in range(4):
        for k in range(12):
            ok = bool(rng.random() < 0.4 + 0.1 * u)
            metas.append(EpisodeMeta(f"unit-{u:04d}-{k:06d}", u, "sawyer", "push-v3", 2, 1000 * u + k, 0.0, 50, ok,
                                     None if ok else 10, False, f"unit-{u:04d}", 50 * k))

    def run(start_times):
        ms = [EpisodeMeta(**{**m.__dict__, "start_time": float(t)}) for m, t in zip(metas, start_times)]
        pr = TaskPriority("learnability", window=10, floor=0.02)
        pr.observe(_Episodes(ms))
        ctx = failure_contexts(_Episodes(ms), max_per_task=6)
        return pr.state_dict()["recent"], [c.episode_id for c in ctx]

    a = run(rng.permutation(len(metas)))
    b = run(rng.permutation(len(metas)))
    assert a == b
    # newest first: the contexts kept are the last commits of the units (the 12th, 11th, ... of each)
    assert [commit_order(m) for m in metas][:2] == [(2, 0, 0, "unit-0000-000000"), (2, 1, 0, "unit-0000-000001")]


def test_stage_match_keeps_only_windows_at_the_stage_the_failure_reached(world):
    """``retrieve(stage_of=...)`` (``fert.stage_match``): every kept window's anchor is at the stage its context had
    reached at its onset; without it some are not (the same contexts and index)."""
    url, _ = world
    reader = ExperienceStore.open(url)
    fert = FertData(reader, FERT_CFG, stats=reader.stats(list(STATE_KEYS)), exclude_units=[HELDOUT])
    fert.update()
    contexts = failure_contexts(reader, exclude_units=[HELDOUT], onsets=fert.onsets)
    queries = embed_contexts(reader, fert.embedder, contexts)
    calls = []

    def stage_of(episode_id, task, step):     # a two-stage task: the second stage from step 15 on (push only)
        calls.append(episode_id)
        return None if task == "reach-v3" else int(step >= 15)

    plain = retrieve(fert.index, queries, contexts, top_k=4)
    staged = retrieve(fert.index, queries, contexts, top_k=4, stage_of=stage_of)
    def off(ret):
        return [i for i in range(len(ret)) if ret.source_task[i] == "push-v3"
                and stage_of(ret.episode_id[i], "push-v3", ret.step[i])
                != stage_of(ret.contexts[ret.context[i]].episode_id, "push-v3", ret.contexts[ret.context[i]].onset)]
    assert off(plain) and not off(staged) and calls
    reach = [i for i in range(len(plain)) if plain.source_task[i] == "reach-v3"]
    assert [plain.episode_id[i] for i in reach] == [staged.episode_id[i] for i in range(len(staged))
                                                    if staged.source_task[i] == "reach-v3"]   # no stages: as before
    np.testing.assert_allclose(staged.weight.sum(), 1.0)
    # through the config: fleet.stages knows neither test task, so retrieval is as before
    cfg = FertData(reader, {**FERT_CFG, "stage_match": True}, stats=reader.stats(list(STATE_KEYS)),
                   exclude_units=[HELDOUT])
    cfg.update()
    assert cfg.retrieve().episode_id == fert.retrieve().episode_id
