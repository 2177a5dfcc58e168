"""The experiment's arms: every policy that the held-out evaluation compares, declared in one registry.

An arm is a name, the base it starts from, the data it is fine-tuned on and whether it trains inside the
fleet loop. Every fine-tuned arm gets the same budget (``fert.rounds x learner.updates_per_version`` updates at
``learner.lr``, batch ``learner.batch_size``), so arms differ only in their data. The arms separate the causes
of a gain:

========================  ===========  =================================================================
arm                       starts from  data
========================  ===========  =================================================================
base                      —            the demonstrations only (no fine-tuning)
base_no_aed               —            the same without the Action Experience Dictionary
filtered_bc               base         every successful fleet episode (+ demos), no retries, no retrieval
filtered_bc_retries       base         the same plus the successful failure retries: exactly the data FERT
                                       sees, without retrieval (credits exploration apart from retrieval)
fert                      base         FERT: failure contexts -> cause-keyed retrieval (own retries first),
                                       progress gate, advantage weights, demo replay; in the fleet loop
fert_no_aed               base_no_aed  FERT without AED, in the same fleet loop as ``fert``
fert_no_retries           base         FERT on the store without the retry episodes
fert_no_gate              base         FERT without the progress gate / advantage weights
fert_abs_key              base         FERT with the old key: absolute standardised state, cosine
fert_aed_key              base         FERT whose key adds the AED action-history embedding (unit dynamics)
fert_confidence           base         FERT whose failure contexts weigh exp(-d^2 / 2 (5 cm)^2) by their
                                       neighbours' distance d; the mass lost goes to replay
fert_replay_fleet         base         FERT replaying every fleet success (filtered BC's data) at 50%
fert_conf_replay          base         both of the above
fert_own_retries          base         FERT whose failures retrieve only their own successful retries: no
                                       fleet neighbour (an unrecovered failure's share goes to replay)
bc_retries_focus          base         filtered_bc_retries with the successful retries tiled to 50% of
                                       the windows (exploration data concentrated, no retrieval)
demos_bc                  base         the demonstrations only, the same budget: no fleet data at all (what
                                       fine-tuning alone does to the base; the control for every other arm)
fert_no_critic            fert         FERT's fine-tuned weights without its success critic (the policy's
                                       own chunk every step): what the retrieval fine-tuning alone gives
fert_finetuned            fert         FERT's fine-tuned weights with its critic (the round's fine-tuned
                                       candidate), whichever candidate the validation gate published:
                                       ``fert - fert_finetuned`` is what the gate's choice adds
base_critic               base         the base's weights with FERT's success critic choosing among its
                                       chunks: what the critic alone gives, without fine-tuning
========================  ===========  =================================================================

``fert`` (and ``fert_no_aed``) ship a success critic with every round when ``fert.critic.enabled``
(``policies.critic``): fitted on the store's successes and failures, it picks one of ``fert.critic.candidates``
chunks sampled from the policy at every decision. The two critic arms reuse checkpoints (no training):
``critic="drop"`` copies its ``init`` checkpoint without the critic's files, ``critic="fert"`` copies its ``init``
checkpoint and adds the ``fert`` arm's critic. With ``learner.validate_critic_only`` the publishing learner's gate
chooses between two candidates per round (``fleet.fert.gate.make_validator``): the fine-tuned weights with the
new critic, and the current version's weights with the new critic; ``fert`` is what it published,
``fert_finetuned`` the fine-tuned candidate either way (``init`` ``"fert_finetuned"``).

``in_loop`` arms are trained round by round by their own ``fleet.fert.learner.FertLearner`` while the fleet
collects (``fert`` publishes the versions the fleet acts with); the others are fine-tuned once the fleet is
done, on the final store, with the same total budget (for one round both see exactly the same store).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fleet.fert.learner import FertLearner
from fleet.registry import checkpoint_with_critic


@dataclasses.dataclass(frozen=True)
class Arm:
    """One compared policy: ``name``, ``init`` (``"base"``/``"base_no_aed"``: the base checkpoint it starts
    from, or is), ``data`` (``"none"``, ``"demos"``, ``"successes"``, ``"successes+retries"``, ``"fert"``), ``fert``
    (overrides of ``cfg.fert`` for ``data="fert"``), ``in_loop``, a one-line ``description`` and
    ``retry_share`` (``data="successes+retries"`` only: the successful retries' share of the training windows,
    reached by repeating the retry episodes; None: each window once) and ``critic`` (``data="none"`` arms made
    from another arm's checkpoint: ``"drop"`` without its success critic, ``"fert"`` with the ``fert`` arm's critic,
    ``"version"`` the ``fert`` arm's newest published version as it is (its critic included), ``"export"`` the
    deployable export of ``init``'s checkpoint run by the ONNX runtime; ``init`` may then be ``"fert"``)."""
    name: str
    init: str
    data: str
    description: str
    fert: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    in_loop: bool = False
    retry_share: float | None = None
    critic: str | None = None


ARMS: dict[str, Arm] = {a.name: a for a in [
    Arm("base", "base", "none", "demonstrations only"),
    Arm("base_no_aed", "base_no_aed", "none", "demonstrations only, no AED"),
    Arm("filtered_bc", "base", "successes", "fleet successes + demos, no retries, no retrieval"),
    Arm("filtered_bc_retries", "base", "successes+retries", "fleet successes + successful retries + demos"),
    Arm("fert", "base", "fert", "FERT: cause-keyed retrieval, own retries first, progress gate", in_loop=True),
    Arm("fert_no_aed", "base_no_aed", "fert", "FERT without AED (same loop)", in_loop=True),
    Arm("fert_no_retries", "base", "fert", "FERT without the retry episodes",
        fert={"include_retries": False, "own_retries_first": False}),
    Arm("fert_no_gate", "base", "fert", "FERT without the progress gate and advantage weights",
        fert={"gate": {"enabled": False}}),
    Arm("fert_abs_key", "base", "fert", "FERT with the absolute cosine key", fert={"key": "absolute"}),
    Arm("fert_aed_key", "base", "fert", "FERT keyed by relative features + the AED action-history embedding",
        fert={"key": "relative+aed"}),
    Arm("fert_confidence", "base", "fert", "FERT with context confidence exp(-d^2 / 2 (5 cm)^2)",
        fert={"confidence_scale_m": 0.05}),
    Arm("fert_replay_fleet", "base", "fert", "FERT replaying every fleet success at 50%",
        fert={"replay": "successes", "replay_ratio": 0.5}),
    Arm("fert_conf_replay", "base", "fert", "FERT with context confidence and fleet-success replay",
        fert={"confidence_scale_m": 0.05, "replay": "successes", "replay_ratio": 0.5}),
    Arm("fert_own_retries", "base", "fert", "FERT retrieving only each failure's own successful retries",
        fert={"neighbours": "own_retries"}),
    Arm("bc_retries_focus", "base", "successes+retries", "filtered BC + retries, retries tiled to 50% of windows",
        retry_share=0.5),
    Arm("demos_bc", "base", "demos", "fine-tuned on the demonstrations only (no fleet data), same budget"),
    Arm("fert_no_critic", "fert_finetuned", "none", "FERT's fine-tuned weights without its success critic",
        critic="drop"),
    Arm("fert_finetuned", "fert_finetuned", "none", "FERT's fine-tuned weights with its critic, whichever candidate "
        "the gate published"),
    Arm("base_critic", "base", "none", "the base's weights with FERT's success critic", critic="fert"),
    Arm("fert_critic", "fert", "none", "FERT's newest version with its success critic (K sampled chunks, the best "
        "executed)", critic="version"),
    Arm("fert_onnx", "fert", "none", "the fert arm's weights exported for deployment (scripts/export.py) and run "
        "by the deploy runtime's ONNX graph, batch 1, as on a robot", critic="export"),
    Arm("fert_no_retrieval", "base", "fert", "the same rounds without retrieval: critic distillation + per-task "
        "replay of the demonstrations and the fleet's successes (filtered BC + retries); its weights alone (K = 1)",
        fert={"mix": {"retrieved": 0.0}}, in_loop=True),
    Arm("fert_no_distill", "base", "fert", "the same rounds without the critic's distillation: retrieval + replay; "
        "its weights alone (K = 1)",
        fert={"distill": {"enabled": False}}, in_loop=True),
    Arm("fert_sim_progress", "base", "fert", "analysis, not deployable: the same rounds with the simulator's progress "
        "signals for the failure onsets and the retrieval gate (what experiment=deployed turns off); its weights "
        "alone (K = 1)", fert={"onset": {"progress": True}}, in_loop=True),
]}

# ``init`` values that name a checkpoint of the in-loop fert arm (what it published; its fine-tuned candidate)
FERT_CHECKPOINTS = frozenset({"fert", "fert_finetuned"})

# (arm, baseline) pairs reported trial by trial, in this order, when both arms ran
PAIRS = [("fert", "base"), ("fert_critic", "base"), ("fert_critic", "fert"), ("fert_onnx", "fert"), ("fert", "filtered_bc"), ("fert", "filtered_bc_retries"), ("fert", "fert_finetuned"),
         ("fert_finetuned", "base"), ("fert_finetuned", "fert_no_critic"), ("fert", "fert_no_critic"),
         ("fert_no_critic", "base"), ("base_critic", "base"), ("fert", "base_critic"),
         ("fert_no_critic", "filtered_bc_retries"), ("filtered_bc_retries", "base"),
         ("filtered_bc_retries", "filtered_bc"),
         ("filtered_bc", "base"), ("fert", "fert_no_retries"), ("fert", "fert_no_gate"), ("fert", "fert_abs_key"),
         ("fert_aed_key", "fert"), ("fert_confidence", "base"), ("fert_replay_fleet", "base"),
         ("fert_conf_replay", "base"), ("fert_confidence", "fert"), ("fert_replay_fleet", "fert"),
         ("fert_conf_replay", "fert"), ("fert_confidence", "filtered_bc"), ("fert_replay_fleet", "filtered_bc"),
         ("fert_conf_replay", "filtered_bc"), ("fert_own_retries", "base"), ("fert_own_retries", "fert"),
         ("fert_own_retries", "filtered_bc_retries"), ("bc_retries_focus", "base"),
         ("bc_retries_focus", "filtered_bc_retries"), ("fert_own_retries", "bc_retries_focus"), ("demos_bc", "base"), ("fert", "demos_bc"),
         ("filtered_bc", "demos_bc"), ("filtered_bc_retries", "demos_bc"), ("fert_no_aed", "base_no_aed"), ("fert", "fert_no_aed"), ("base", "base_no_aed"),
         ("fert", "fert_no_retrieval"), ("fert_no_retrieval", "base"), ("fert", "fert_no_distill"),
         ("fert_no_distill", "base"), ("fert_no_retrieval", "filtered_bc_retries"),
         ("fert_sim_progress", "fert"), ("fert_sim_progress", "fert_no_retrieval"), ("fert_sim_progress", "base")]


def get_arms(names: Iterable[str]) -> list[Arm]:
    """The registry entries for ``names``, in order.

    Raises:
        ValueError: an unknown arm name (the message lists the known ones), or a repeated one.
    """
    names = list(names)
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"job.arms: unknown arms {unknown}; known: {sorted(ARMS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"job.arms: repeated arm names in {names}")
    need_fert = [n for n in names if ARMS[n].critic is not None or ARMS[n].init in FERT_CHECKPOINTS]
    if need_fert and "fert" not in names:
        raise ValueError(f"job.arms: {need_fert} are made from the fert arm's checkpoint or critic; add fert")
    return [ARMS[n] for n in names]


def fert_config(cfg: dict, arm: Arm) -> dict:
    """``cfg`` with the arm's ``fert`` overrides merged in (nested dicts merged one level deep)."""
    fert = dict(cfg["fert"])
    for k, v in arm.fert.items():
        fert[k] = {**dict(fert.get(k) or {}), **v} if isinstance(v, Mapping) else v
    return {**cfg, "fert": fert}


def finetune_budget(cfg: dict) -> int:
    """Updates every fine-tuned arm gets: ``fert.rounds * learner.updates_per_version``."""
    return int(cfg["fert"]["rounds"]) * int(cfg["learner"]["updates_per_version"])


def make_learner(cfg: dict, arm: Arm, work_dir: Path, init_ckpt: str, registry_url: str | None, seed: int,
                 offline: bool = False, validator=None):
    """The ``FertLearner`` that trains a ``data="fert"`` arm (publishing to ``registry_url`` unless None).
    ``offline``: the round runs on the store as it is (no waiting for new fleet episodes: the protocol's fleet
    round has finished when its learners run)."""
    c = fert_config(cfg, arm)
    learner = {**c["learner"], "seed": int(seed)}
    if offline:   # learner.torch_threads as configured: 2 threads trained ~2x slower than 1 here (experiment 26)
        learner.update(min_new_episodes=0, max_wait_s=0)
    c = {**c, "learner": learner}
    return FertLearner(c, c["store"]["url"], registry_url, str(work_dir), init_ckpt, run_id=arm.name,
                       publish=registry_url is not None, validator=validator)


def with_retry_share(episodes: list, share: float) -> list:
    """``episodes`` with the retry episodes (``extra.retry_of`` set) repeated ``k`` times, ``k >= 1`` the integer
    that brings their steps nearest to ``share`` of all steps (uniform window sampling then draws retries at
    about that rate). Unchanged when there are no retries or no other episodes.

    Raises:
        ValueError: ``share`` outside (0, 1).
    """
    from fleet.fert.contexts import retry_of

    if not 0.0 < share < 1.0:
        raise ValueError(f"retry_share: expected a value in (0, 1), given {share}")
    retries = [m for m in episodes if retry_of(m)]
    others = [m for m in episodes if not retry_of(m)]
    n_r, n_o = sum(int(m.length) for m in retries), sum(int(m.length) for m in others)
    if not n_r or not n_o:
        return list(episodes)
    k = max(1, round(share / (1.0 - share) * n_o / n_r))
    return others + retries * k


def arm_episodes(arm: Arm, successes: Sequence, heldout: Iterable[int]) -> list:
    """The episodes an offline BC arm trains on, from the store's successful ``successes`` (EpisodeMeta):
    training units only; ``data="demos"`` the demonstrations, ``"successes"`` every success but the failure
    retries, ``"successes+retries"`` all of them (retries tiled to ``arm.retry_share`` when set)."""
    from fleet.fert.contexts import retry_of

    held = {int(u) for u in heldout}
    eps = [m for m in successes if int(m.unit_id) not in held
           and (arm.data == "successes+retries" or not retry_of(m)) and (arm.data != "demos" or m.is_demo)]
    return with_retry_share(eps, float(arm.retry_share)) if arm.retry_share is not None else eps


def train_offline_arm(cfg: dict, arm: Arm, reader, init_ckpt: str, out_dir: Path, heldout: list[int],
                      seed: int) -> str:
    """Fine-tune one arm that is not trained in the fleet loop on the final store; returns its
    ``pretrained_model`` directory. ``data="demos"``: the demonstrations only; ``data="successes"`` /
    ``"successes+retries"``: filtered BC (uniform over the windows of the successful training-unit episodes,
    the demonstrations included); ``data="fert"``: the arm's FERT rounds run one after the other on the final
    store. With ``learner.wise_alpha`` set, the returned policy is the fine-tuned one interpolated toward
    ``init_ckpt`` (WiSE-FT, as the learner publishes it).

    Raises:
        ValueError: an arm without fine-tuning (``data="none"``) or an unknown ``data``.
    """
    from policies.aed_diffusion.training import train_policy
    from policies.factory import deployed_checkpoint, load_policy

    if arm.data == "fert":
        lrn = make_learner(cfg, arm, out_dir, init_ckpt, None, seed, offline=True)
        lrn.run(int(cfg["fert"]["rounds"]))
        return lrn.final_checkpoint()
    if arm.data not in ("demos", "successes", "successes+retries"):
        raise ValueError(f"arm {arm.name!r}: data {arm.data!r} is not fine-tuned offline")
    reader.refresh()
    eps = arm_episodes(arm, reader.episodes(success=True), heldout)
    updates = finetune_budget(cfg)
    tcfg = {k: v for k, v in cfg["train"].items() if k not in ("out_dir", "init_from", "episodes")}
    tcfg.update(steps=updates, lr=float(cfg["learner"]["lr"]), warmup_steps=0, seed=int(seed),
                batch_size=int(cfg["learner"]["batch_size"]), save_every=updates, progress=False)
    tcfg["wandb"] = {**tcfg.get("wandb", {}), "name": arm.name}
    res = train_policy(tcfg, out_dir, policy=load_policy(init_ckpt), reader=reader,
                       episodes=eps, device=cfg["device"])
    return deployed_checkpoint(cfg["learner"].get("wise_alpha"), init_ckpt, res["checkpoint"], out_dir / "wise")


def train_offline_arms_process(cfg: dict, jobs: list, heldout: list[int], seed: int) -> dict:
    """:func:`train_offline_arm` for each ``(arm, init checkpoint, out dir)`` of ``jobs``, one after the other,
    in a process of its own (``fleet.experiment.offline`` runs it beside the last round's learner, in a spawned process:
    it opens its own reader of ``cfg.store``). Returns ``{arm name: (checkpoint, wall_s)}``."""
    import time

    from experience_dict.store import configure_storage
    from fleet.labels import learner_reader
    from policies.threads import passive_wait

    passive_wait()
    configure_storage(cfg["store"])
    reader = learner_reader(cfg["store"]["url"], cfg.get("labels"))   # labels.trust_margin's view
    out = {}
    for arm, init, out_dir in jobs:
        t0 = time.perf_counter()
        out[arm.name] = (train_offline_arm(cfg, arm, reader, init, Path(out_dir), heldout, seed),
                         time.perf_counter() - t0)
    return out


def num_inference_steps(checkpoint: str | Path) -> int:
    """The DDIM step count a checkpoint's ``config.json`` samples with."""
    import json

    return int(json.loads((Path(checkpoint) / "config.json").read_text())["num_inference_steps"])


def critic_arm_checkpoint(arm: Arm, ckpt: dict, out_dir: str | Path) -> str:
    """The checkpoint of a critic arm (``arm.critic`` set): ``ckpt[arm.init]``'s files copied to ``out_dir``
    without the success critic (``"drop"``), or with the critic FERT fitted in its last round (``"fert"``: from
    ``ckpt["fert_finetuned"]``, the round's fine-tuned candidate, or ``ckpt["fert"]`` when that is absent).

    Raises:
        ValueError: ``arm.critic`` unknown, or ``"fert"`` when the fert checkpoint has no critic
            (``fert.critic.enabled: false``).
    """
    if arm.critic not in ("drop", "fert", "version", "export"):
        raise ValueError(f"arm {arm.name}: critic must be 'drop', 'fert', 'version' or 'export', given {arm.critic!r}")
    if arm.critic == "version":   # the fert arm's newest published version as it is, its critic included
        return str(ckpt.get("fert_version", ckpt[arm.init]))
    if arm.critic == "export":    # the deployable export of ckpt[arm.init] with its ONNX chunk graph (batch 1)
        from policies.export import export_checkpoint

        out = Path(out_dir)
        if not (out / "export.json").is_file():
            export_checkpoint(ckpt[arm.init], out, overwrite=True, onnx_steps=[int(num_inference_steps(ckpt[arm.init]))],
                              source={"kind": "arm", "arm": arm.init})
        return str(out)
    try:
        return checkpoint_with_critic(ckpt[arm.init], out_dir,
                                      ckpt.get("fert_finetuned", ckpt["fert"]) if arm.critic == "fert" else None)
    except ValueError as e:
        raise ValueError(f"arm {arm.name}: {e}") from None
