"""The asynchronous FERT learner: trains from the growing store and publishes policy versions.

One round, read top to bottom in :meth:`FertLearner.run_round`:

1. wait until the fleet has committed ``min_new_episodes`` episodes since the last round (collection never
   waits for training; training waits only for *fleet* data, never for one unit);
2. ``FertData.update``: refresh the store snapshot, locate failure onsets, index new successful windows;
3. ``FertData.retrieve``: failure contexts of the training units -> top-k successful windows of the same task
   from the whole fleet (the method of "Learning from Fleet Experience", see docs/FLEET_LEARNING.md);
4. train ``updates_per_version`` updates on the retrieved windows mixed with demonstration replay
   (``policies.aed_diffusion.training.train_policy``, resumable);
5. with ``fert.critic.enabled``, fit a success critic on the store's successes *and* failures and save it beside
   the weights (``policies.critic``: the policy then executes, of K sampled chunks, the one it ranks highest);
6. write the retrieval audit, publish the weights (and critic) as the next policy version (atomically, sha256
   manifest).

Fault tolerance: the trainer's checkpoints (weights, EMA, optimizer, LR schedule, step) live in
``<work_dir>/train``; the round cursor in ``<work_dir>/learner_state.json`` (written atomically). A learner
killed at any point restarts, resumes training from the last checkpoint, and publishes each round once:
before publishing it looks for a registry version already carrying its ``(run_id, round)``.

Runs in-process (tests, notebooks) or as a Ray actor (``ray.remote(FertLearner)``, one GPU when present).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experience_dict.atomic import atomic_write_text
from fleet.fert.config import FertConfig
from fleet.fert.learner_config import ROUND_INIT, LearnerConfig

log = logging.getLogger(__name__)



def _atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1))


class FertLearner:
    """Failure-guided experience retrieval fine-tuning, run continuously beside the fleet.

    Args:
        cfg: plain dict with ``fert`` (fields of :class:`fleet.fert.config.FertConfig`), ``train``
            (of :class:`policies.train_config.TrainConfig`), ``learner`` (of
            :class:`fleet.fert.learner_config.LearnerConfig`) and ``robot`` (for the held-out units, never used for training).
        store_url: the fleet's experience store.
        registry_url: where versions are published.
        work_dir: the learner's own directory (training checkpoints, state, audits).
        init_checkpoint: ``pretrained_model`` directory the fine-tuning starts from (the base policy).
        run_id: names this learner's versions in the registry metadata (so a restart never republishes).
        publish: False trains and audits without publishing (offline arms such as FERT without AED).
        validator: optional ``f({name: pretrained_model dir}, round) -> (chosen name or None, record: dict)`` run
            before publishing, on the round's candidates: ``"finetuned"`` (the fine-tuned weights, with the new
            success critic when one is fitted) and, with ``learner.validate_critic_only`` and a critic,
            ``"critic_only"`` (the current version's weights with the new critic,
            :meth:`critic_only_candidate`). The chosen candidate is published; a rejected round (None) is
            recorded (``state["rejected"]``, the round's ``validation``) and not published, so the fleet keeps
            acting with the last accepted version; training goes on from the fine-tuned weights in the next
            round either way (drift control by gating what the fleet runs).
    """

    def __init__(self, cfg: dict, store_url: str, registry_url: str | None, work_dir: str, init_checkpoint: str,
                 run_id: str = "fert", publish: bool = True, validator: Callable | None = None):
        os.environ.setdefault("WANDB_MODE", "offline")
        self.cfg = cfg
        self.lcfg = LearnerConfig.from_dict(cfg.get("learner"))
        self.fcfg = FertConfig.from_dict(cfg.get("fert"))
        self.store_url, self.registry_url = store_url, registry_url
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.init_checkpoint = str(init_checkpoint)
        self.run_id = run_id
        self.publish_versions = publish and registry_url is not None
        self.validator = validator
        self.heldout = [int(u) for u in cfg["robot"]["heldout_units"]]
        if self.lcfg.torch_threads:
            import torch

            torch.set_num_threads(int(self.lcfg.torch_threads))
        self.state_path = self.work_dir / "learner_state.json"
        self.state = self._load_state()
        self._fert = None
        self._reader = None
        self._range_seen: set[str] = set()   # fleet episodes whose actions tokenizer_range has counted

    # ------------------------------------------------------------------ state
    def _load_state(self) -> dict:
        if self.state_path.is_file():
            return json.loads(self.state_path.read_text())
        return {"round": 0, "published": [], "rejected": [], "episodes_seen": 0, "history": []}

    def status(self) -> dict:
        """JSON-able: round cursor, published versions, per-round history."""
        return json.loads(json.dumps(self.state))

    # ------------------------------------------------------------------ data
    def _setup(self):
        if self._fert is not None:
            return
        from experience_dict.store import ExperienceStore, configure_storage
        from fleet.fert.data import FertData

        configure_storage({**dict(self.cfg.get("store") or {}), "url": self.store_url})
        self._reader = ExperienceStore.open(self.store_url)
        demos = self._reader.episodes(is_demo=True)
        if not demos:
            raise RuntimeError(f"store {self.store_url!r} holds no demonstrations to replay")
        stats = self._reader.stats(["observation.state", "observation.environment_state"], episodes=demos)
        fert_cfg = self.fcfg
        if fert_cfg.gate.tail_steps is None:   # the steps a successful episode runs on after its first success
            tail = int((self.cfg.get("task") or {}).get("steps_after_success", 0) or 0)
            fert_cfg = dataclasses.replace(fert_cfg, gate=dataclasses.replace(fert_cfg.gate, tail_steps=tail))
        aed_key = None
        if fert_cfg.key == "relative+aed":   # the key's AED part: the (fixed) initial policy's dictionary
            from fleet.fert.keys import aed_history_encoder
            from policies.factory import load_policy

            self._key_policy = load_policy(self.init_checkpoint)
            aed_key = aed_history_encoder(self._key_policy, float(fert_cfg.aed_key_scale_m))
        self._fert = FertData(self._reader, fert_cfg, stats=stats, exclude_units=self.heldout, aed_key=aed_key)

    def tokenizer_range(self, policy) -> dict | None:
        """How many of the fleet's new action groups (training units, episodes not counted by an earlier round
        of this process) fall outside the range the policy's AED tokenizer was fitted on: those are clipped
        before tokenization, so their history tokens no longer round-trip within the tokenizer's tolerance.
        Logged as a warning past ``fert.tokenizer_range_warn`` (a share of groups). The token vocabulary is the
        AED embedding table's, so it is not refitted mid-fine-tuning: a share that stays high calls for a new
        base (``job.base_steps``' tokenizer fitted on data that covers the fleet's actions).

        Returns:
            :meth:`experience_dict.tokenizer.ActionTokenizer.range_report` plus ``"episodes"``; None without a
            tokenizer (AED off).
        """
        tok = getattr(policy, "tokenizer", None)
        if tok is None:
            return None
        new = [m for m in self._reader.episodes(is_demo=False)
               if int(m.unit_id) not in self.heldout and m.episode_id not in self._range_seen]
        rep = tok.range_report([self._reader.load_episode(m.episode_id, ["action"])["action"] for m in new])
        self._range_seen.update(m.episode_id for m in new)
        rep["episodes"] = len(new)
        warn = float(self.fcfg.tokenizer_range_warn)
        if rep["groups"] and rep["share"] > warn:
            log.warning("learner %s: %d of %d new fleet action groups (%.1f %%) lie outside the AED tokenizer's "
                        "fitted range (per dimension %s; fitted low %s, high %s; seen %s .. %s) and are clipped "
                        "(fert.tokenizer_range_warn %.2f); a base whose tokenizer covers them needs new demos or "
                        "a wider fit", self.run_id, rep["outside"], rep["groups"], 100 * rep["share"],
                        rep["outside_per_dim"], [round(x, 3) for x in rep["low"]],
                        [round(x, 3) for x in rep["high"]], [round(x, 3) for x in rep["seen_low"]],
                        [round(x, 3) for x in rep["seen_high"]], warn)
        return rep

    def replay_episodes(self, mode: str | None = None) -> list:
        """The episodes a round replays beside its retrieved windows (``fert.replay``): ``demos`` (default),
        the demonstrations; ``successes``, the demonstrations plus every successful episode of the training
        units (the successful failure retries too when ``fert.include_retries``), i.e. filtered BC's data.

        Raises:
            ValueError: an unknown ``fert.replay``.
        """
        from fleet.fert.contexts import retry_of

        mode = str(mode or self.fcfg.replay)
        if mode not in ("demos", "successes"):
            raise ValueError(f"fert.replay: expected 'demos' or 'successes', given {mode!r}")
        demos = self._reader.episodes(is_demo=True)
        if mode == "demos":
            return demos
        retries = bool(self.fcfg.include_retries)
        ids = {m.episode_id for m in demos}
        fleet = [m for m in self._reader.episodes(success=True) if m.episode_id not in ids
                 and int(m.unit_id) not in self.heldout and (retries or not retry_of(m))]
        return demos + fleet

    def _n_fleet_episodes(self) -> int:
        self._reader.refresh()
        return len([m for m in self._reader.episodes(is_demo=False) if int(m.unit_id) not in self.heldout])

    def _wait_for_data(self, should_stop: Callable[[], bool] | None) -> int:
        need = self.state["episodes_seen"] + int(self.lcfg.min_new_episodes)
        deadline = time.monotonic() + float(self.lcfg.max_wait_s)
        n = self._n_fleet_episodes()
        while n < need and time.monotonic() < deadline and not (should_stop and should_stop()):
            time.sleep(float(self.lcfg.poll_s))
            n = self._n_fleet_episodes()
        return n

    # ------------------------------------------------------------------ one round
    def run_round(self, should_stop: Callable[[], bool] | None = None) -> dict:
        """Run the next FERT round (wait for data, retrieve, train, audit, publish); returns its record.

        ``learner.round_init``: ``continue`` trains on from the last round's fine-tuned weights (one long run,
        the success critic fitted after it and shipped for chunk selection); ``published`` (the default) starts
        every round from the version the fleet runs now (:meth:`round_init_checkpoint`), fits the success
        critic first and, with ``fert.distill.enabled``, fine-tunes the policy on the chunks that critic ranks
        best among the policy's own samples at the fleet's states (``policies.distill``, PA-RL), mixed with the
        retrieved segments and per-task replay (:meth:`round_dataset`): each round's version improves on the
        last, and the validation gate compares the policies alone (K = 1)."""
        self._setup()
        r = int(self.state["round"])
        n_eps = self._wait_for_data(should_stop)
        if self.iterative:
            return self._run_iterative_round(r, n_eps)
        from fleet.fert.audit import write_retrieval_audit
        from policies.aed_diffusion.training import train_policy
        from policies.factory import load_policy

        t0 = time.perf_counter()
        upd = self._fert.update()
        retrieval = self._fert.retrieve()
        policy = load_policy(self.init_checkpoint).train()
        tok_range = self.tokenizer_range(policy)
        demos = self.replay_episodes()
        round_seed = 1000 * self.lcfg.seed + r
        dataset = self._fert.dataset(retrieval, demos, policy.window_spec(), seed=round_seed)
        out = train_policy(self._train_cfg(round_seed, (r + 1) * int(self.lcfg.updates_per_version)),
                           self.work_dir / "train", policy=policy, dataset=dataset, device=str(self.lcfg.device))
        ckpt = self.deployed_checkpoint(out["checkpoint"], r)
        critic = self.fit_critic(ckpt, policy, round_seed)
        audit = None
        if self.fcfg.audit and len(retrieval):
            audit = write_retrieval_audit(retrieval, self._fert.index, self.work_dir / "audits", r,
                                          tokenizer_range=tok_range)
        validation, chosen, candidates = None, "finetuned", {"finetuned": ckpt}
        if self.validator is not None and self.publish_versions:
            if critic is not None and self.lcfg.validate_critic_only:
                candidates["critic_only"] = self.critic_only_candidate(ckpt, r)
            chosen, validation = self.validator(candidates, r)
            if chosen is None:
                self.state.setdefault("rejected", []).append(r)
        version = self._publish_once(candidates[chosen], r, out) if chosen else None
        rec = {"validation": validation, "round": r, "version": version,
               "published_candidate": chosen if version is not None else None, "step": int(out["step"]),
               "fleet_episodes": n_eps,
               "contexts": len(retrieval.contexts), "retrieved": len(retrieval), "dataset": len(dataset),
               "update": upd, "loss": (out.get("metrics") or {}).get("loss"), "train_s": time.perf_counter() - t0,
               "audit": (audit or {}).get("files"), "critic": critic, "checkpoint": str(ckpt),
               "tokenizer_range": tok_range}
        return self._finish_round(r, n_eps, rec, retrieval)

    @property
    def iterative(self) -> bool:
        """``learner.round_init`` is ``published`` or ``base``: every round is a round of its own (critic, distillation,
        gate; see run_round) starting from the current version or from the loop's initial weights.

        Raises:
            ValueError: an unknown ``learner.round_init``."""
        mode = self.lcfg.round_init
        if mode not in ROUND_INIT:
            raise ValueError(f"learner.round_init: expected one of {list(ROUND_INIT)}, given {mode!r}")
        return mode != "continue"

    def _train_cfg(self, seed: int, steps: int) -> dict:
        return {**dict(self.cfg.get("train") or {}), "seed": seed, "steps": int(steps), "resume": True,
                "lr": float(self.lcfg.lr), "warmup_steps": int(self.lcfg.warmup_steps),
                "batch_size": int(self.lcfg.batch_size), "save_every": int(self.lcfg.updates_per_version),
                # the learner's own thread count (learner.torch_threads), not the base training's train.num_threads
                **({"num_threads": int(self.lcfg.torch_threads)} if self.lcfg.torch_threads else {}),
                "progress": False, "wandb": {**dict((self.cfg.get("train") or {}).get("wandb") or {}),
                                             "name": f"learner-{self.run_id}"}}

    def _finish_round(self, r: int, n_eps: int, rec: dict, retrieval) -> dict:
        self.state["round"] = r + 1
        self.state["episodes_seen"] = n_eps
        self.state["history"].append(rec)
        _atomic_write_json(self.state_path, self.state)
        own = int(retrieval.own_retry.sum()) if retrieval.own_retry is not None else 0
        rec["own_retry_entries"] = own
        log.info("learner %s round %d: %d contexts, %d retrieved (%d from own retries), v%s", self.run_id, r,
                 rec["contexts"], rec["retrieved"], own, rec["version"])
        return rec

    def round_init_checkpoint(self) -> str:
        """The weights the next round starts from. ``learner.round_init: base``: the learner's initial checkpoint
        (the base), every round. ``published``: a publishing learner's current
        registry version (what the fleet acts with; fetched into ``<work_dir>/init``), else this learner's own
        last round's output, else its initial checkpoint. With ``learner.after_reject: candidate``, after a round
        the gate rejected: that round's own weights (its lineage goes on; the fleet keeps the published version).

        Raises:
            ValueError: an unknown ``learner.after_reject``."""
        if self.lcfg.round_init == "base":   # every round from the loop's initial weights, on the whole store
            return self.init_checkpoint
        hist = [h for h in self.state.get("history") or [] if h.get("checkpoint")]
        after = self.lcfg.after_reject
        if after not in ("published", "candidate"):
            raise ValueError(f"learner.after_reject: expected 'published' or 'candidate', given {after!r}")
        if after == "candidate" and hist and hist[-1].get("round") in (self.state.get("rejected") or []):
            return str(hist[-1]["checkpoint"])
        return self.current_checkpoint()

    def current_checkpoint(self) -> str:
        """The weights the fleet acts with: a publishing learner's newest registry version (fetched into
        ``<work_dir>/init``), else this learner's own last round's output, else its initial checkpoint."""
        if self.publish_versions:
            from fleet.registry import CheckpointRegistry

            reg = CheckpointRegistry(self.registry_url)
            v = reg.latest_version()
            if v is not None:
                return str(reg.fetch(v, self.work_dir / "init" / f"v{v:06d}"))
        hist = [h for h in self.state.get("history") or [] if h.get("checkpoint")]
        return str(hist[-1]["checkpoint"]) if hist else self.init_checkpoint

    def _run_iterative_round(self, r: int, n_eps: int) -> dict:
        """One round of the ``published`` mode (see :meth:`run_round`)."""
        from fleet.fert.audit import write_retrieval_audit
        from fleet.registry import checkpoint_with_critic
        from policies.aed_diffusion.training import train_policy
        from policies.critic import save_critic
        from policies.factory import deployed_checkpoint, load_policy

        times: dict[str, float] = {}
        t0 = time.perf_counter()
        upd = self._fert.update()
        retrieval = self._fert.retrieve()
        times["retrieval_s"] = time.perf_counter() - t0
        init = self.round_init_checkpoint()
        policy = load_policy(init)
        tok_range = self.tokenizer_range(policy)
        round_seed = 1000 * self.lcfg.seed + r
        rdir = self.work_dir / "rounds" / f"round_{r:03d}"
        # the critic is fitted in a process of its own while this one samples the policy's candidate chunks for
        # the distillation (neither needs the other; one thread each, so the 2-core machine's second core works)
        t = time.perf_counter()
        finish_critic = self.start_critic_fit(policy, round_seed, rdir / "critic_fit")
        sampled = None
        if self._distill_on():
            sampled = self.distill_candidates(policy.eval(), round_seed)
            times["candidates_s"] = time.perf_counter() - t
        critic, crit_rec, candidates_k = finish_critic()
        times["critic_s"] = time.perf_counter() - t   # the fit, and the candidates' sampling beside it
        t = time.perf_counter()
        dataset, mix = self.round_dataset(retrieval, policy.eval(), critic, candidates_k, round_seed, sampled=sampled)
        times["distill_s"] = time.perf_counter() - t
        t = time.perf_counter()
        out = train_policy(self._train_cfg(round_seed, int(self.lcfg.updates_per_version)), rdir / "train",
                           policy=policy.train(), dataset=dataset, device=str(self.lcfg.device))
        times["train_s"] = time.perf_counter() - t
        ckpt = deployed_checkpoint(self.lcfg.wise_alpha, init, out["checkpoint"], rdir / "wise")
        ckpt = checkpoint_with_critic(ckpt, rdir / "policy", None)   # the round's weights, without any critic
        if critic is not None:
            save_critic(critic, ckpt, candidates_k)
        audit = None
        if self.fcfg.audit and len(retrieval):
            audit = write_retrieval_audit(retrieval, self._fert.index, self.work_dir / "audits", r,
                                          tokenizer_range=tok_range)
        validation, chosen = None, "finetuned"
        candidates = {"finetuned": ckpt}
        if self.validator is not None and self.publish_versions:
            t = time.perf_counter()
            alone = checkpoint_with_critic(ckpt, rdir / "policy_alone", None)
            name, validation = self.validator({"finetuned": alone}, r, policy_alone=True)
            times["validation_s"] = time.perf_counter() - t
            if name is None:   # rejected: the fleet keeps the current weights, with the new critic
                self.state.setdefault("rejected", []).append(r)
                chosen = "critic_only" if critic is not None else None
                if chosen:
                    candidates["critic_only"] = checkpoint_with_critic(self.current_checkpoint(), rdir / "critic_only",
                                                                       ckpt)
        version = self._publish_once(candidates[chosen], r, out) if chosen else None
        rec = {"validation": validation, "round": r, "version": version, "init": init,
               "published_candidate": chosen if version is not None else None, "step": int(out["step"]),
               "fleet_episodes": n_eps, "contexts": len(retrieval.contexts), "retrieved": len(retrieval),
               "dataset": len(dataset), "mix": mix, "update": upd, "loss": (out.get("metrics") or {}).get("loss"),
               "train_s": time.perf_counter() - t0, "times": times, "audit": (audit or {}).get("files"),
               "critic": crit_rec, "checkpoint": str(ckpt), "tokenizer_range": tok_range}
        return self._finish_round(r, n_eps, rec, retrieval)

    def _distill_on(self) -> bool:
        """Whether a round trains on critic targets: ``fert.distill.enabled``, a critic with K >= 2 candidates and
        a positive ``fert.mix.distill`` share."""
        fc = self.fcfg
        return bool(fc.distill.enabled and fc.critic.enabled and fc.critic.candidates > 1 and fc.mix.distill > 0)

    def distill_candidates(self, policy, seed: int) -> list[dict]:
        """The critic targets' first half (``policies.distill.sample_candidates``): ``policy`` (eval mode, the
        round's starting weights) samples ``fert.critic.candidates`` chunks at ``fert.distill.states_per_task``
        states per task of :meth:`critic_episodes` (``policies.distill.balanced_anchors``), for
        :meth:`round_dataset` to rank with the round's critic."""
        from experience_dict.sampler import WindowDataset
        from policies.distill import balanced_anchors, sample_candidates

        fc = self.fcfg
        windows = WindowDataset(self._reader, self.critic_episodes(), windows=policy.window_spec())
        anchors = balanced_anchors(windows, fc.distill.states_per_task, seed)
        return sample_candidates(policy, windows, anchors, fc.critic.candidates, critic_state_keys(policy), seed,
                                 fc.distill.batch_size)

    def round_dataset(self, retrieval, policy, critic, candidates: int, seed: int, sampled: list | None = None):
        """The training windows of an iterative round: a ``experience_dict.sampler.MixtureDataset`` of
        ``learner.updates_per_version x learner.batch_size`` slots with shares ``fert.mix``:

        * ``retrieved``: FERT's retrieved segments (``FertDataset`` without replay; the similarity and advantage
          weights as ``sample_weight``);
        * ``distill``: critic targets (``policies.distill.critic_targets``) at ``fert.distill.states_per_task``
          states per task drawn from every training-unit episode in the store (demonstrations, fleet episodes
          successful or not, failure retries), relabelled by ``policy`` (the round's starting weights) and
          ``critic`` among ``candidates`` samples; only with ``fert.distill.enabled`` and a critic;
        * ``replay``: per-task balanced replay, each task an equal share, over its demonstrations and its
          successful training-unit episodes (the fleet's and the retries').

        ``sampled``: :meth:`distill_candidates`' output, already drawn (only ranked here); None: drawn here.

        Returns ``(dataset, record)``; record: ``{"slots": {part: slots}, "distill": critic_targets' record}``.
        """
        from experience_dict.sampler import MixtureDataset, WindowDataset
        from fleet.fert.dataset import FertDataset
        from policies.distill import choose_targets

        shares = dataclasses.asdict(self.fcfg.mix)
        spec = policy.window_spec()
        keys = list(spec) + [f"{n}_is_pad" for n in spec]
        parts = []
        if len(retrieval):
            parts.append(("retrieved", FertDataset(self._reader, retrieval, [], spec, replay_ratio=0.0,
                                                   weighting=self.fcfg.weighting, seed=seed,
                                                   segment_steps=self.fcfg.segment_steps),
                          shares["retrieved"]))
        rec: dict = {}
        if critic is not None and candidates > 1 and self._distill_on():   # the same rule the round sampled by
            if sampled is None:
                sampled = self.distill_candidates(policy, seed)
            targets, rec["distill"] = choose_targets(critic, sampled)
            parts.append(("distill", targets, shares["distill"]))
        ok = self.replay_episodes(mode="successes")
        tasks = sorted({m.task for m in ok})
        for task in tasks:
            parts.append((f"replay:{task}", WindowDataset(self._reader, [m for m in ok if m.task == task], windows=spec),
                          shares["replay"] / len(tasks)))
        size = int(self.lcfg.updates_per_version) * int(self.lcfg.batch_size)
        ds = MixtureDataset(parts, keys, size, seed)
        rec["slots"] = ds.slots
        log.info("learner %s: round data %s", self.run_id, ds.slots)
        return ds, rec

    def critic_episodes(self) -> list:
        """The episodes the round's success critic learns from: every committed, unquarantined episode of the
        training units (demonstrations, fleet successes and failures; the failure retries when
        ``fert.include_retries``)."""
        from fleet.fert.contexts import retry_of

        retries = bool(self.fcfg.include_retries)
        return [m for m in self._reader.episodes() if int(m.unit_id) not in self.heldout
                and not getattr(m, "quarantined", False) and (retries or not retry_of(m))]

    def start_critic_fit(self, policy, seed: int, out_dir: Path) -> Callable[[], tuple]:
        """Start :meth:`fit_critic_model`'s fit and return a function that waits for it and returns its
        ``(critic, record, candidates)``. On the CPU with ``fert.critic.fit_process`` (default), the fit runs in a
        spawned process with ``learner.torch_threads`` threads (the critic handed back through
        ``<out_dir>/critic.safetensors``), so this process can sample the distillation's candidates meanwhile;
        otherwise the returned function fits here. Either way the critic is the same: :func:`fit_critic` seeds
        itself and the thread count is the same.

        Raises (from the returned function):
            RuntimeError: the fitting process failed (its error chained)."""
        ccfg = self.fcfg.critic
        from fleet.acting import resolve_device

        device = resolve_device(str(self.lcfg.device))
        if not ccfg.enabled or not ccfg.fit_process or str(device) != "cpu":
            return lambda: self.fit_critic_model(policy, seed)
        import concurrent.futures
        import multiprocessing

        import torch

        from policies.critic import load_critic

        keys = critic_state_keys(policy)
        args = (self.store_url, [m.episode_id for m in self.critic_episodes()], keys, int(policy.config.action_dim),
                int(policy.config.n_action_steps), int((self.cfg.get("task") or {}).get("steps_after_success", 0) or 0),
                dataclasses.asdict(ccfg), int(seed), int(self.lcfg.torch_threads or torch.get_num_threads()),
                str(out_dir), ccfg.candidates)
        ex = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        fut = ex.submit(fit_critic_process, *args)
        t0 = time.perf_counter()

        def finish() -> tuple:
            try:
                rec = fut.result()
            except Exception as e:
                raise RuntimeError(f"learner {self.run_id}: fitting the success critic in its process failed: "
                                   f"{type(e).__name__}: {e}") from e
            finally:
                ex.shutdown()
            critic, k = load_critic(out_dir)
            rec["wait_s"] = time.perf_counter() - t0
            log.info("learner %s: success critic on %d episodes (%d steps), validation BCE %s, %.0f s (own process)",
                     self.run_id, rec["episodes"], rec["steps"], rec["val_loss"], rec["fit_s"])
            return critic, rec, k

        return finish

    def fit_critic_model(self, policy, seed: int):
        """With ``fert.critic.enabled``: a success critic (``fleet.fert.critic_fit.fit_critic``) fitted on
        :meth:`critic_episodes` for ``policy``'s state keys and chunk; returns ``(critic, record with "fit_s",
        candidates)``, or ``(None, None, 1)`` when disabled."""
        ccfg = self.fcfg.critic
        if not ccfg.enabled:
            return None, None, 1
        from fleet.acting import resolve_device
        from fleet.fert.critic_fit import fit_critic

        keys = critic_state_keys(policy)
        t0 = time.perf_counter()
        critic, rec = fit_critic(self._reader, self.critic_episodes(), keys, int(policy.config.action_dim),
                                 int(policy.config.n_action_steps),
                                 int((self.cfg.get("task") or {}).get("steps_after_success", 0) or 0),
                                 dataclasses.asdict(ccfg), seed=seed, device=resolve_device(str(self.lcfg.device)))
        critic = critic.cpu()
        rec["fit_s"] = time.perf_counter() - t0
        log.info("learner %s: success critic on %d episodes (%d steps), validation BCE %s, %.0f s", self.run_id,
                 rec["episodes"], rec["steps"], rec["val_loss"], rec["fit_s"])
        return critic, rec, ccfg.candidates

    def fit_critic(self, checkpoint: str | Path, policy, seed: int) -> dict | None:
        """:meth:`fit_critic_model`, the critic saved into ``checkpoint`` (validated and published with the
        weights, so the fleet and the evaluation choose chunks with it); returns the fit's record, or None when
        disabled."""
        from policies.critic import save_critic

        critic, rec, k = self.fit_critic_model(policy, seed)
        if critic is not None:
            save_critic(critic, checkpoint, k)
        return rec

    def critic_only_candidate(self, checkpoint: str | Path, r: int) -> str:
        """Round ``r``'s second candidate: the weights of the version the fleet runs now (the registry's newest)
        with the success critic just fitted into ``checkpoint``, in ``<work_dir>/critic_only/round_<r>``. A critic
        fitted on the fleet's successes and failures can help the current weights without the fine-tuning (on one
        seed of experiment 19 the fine-tuned weights lost 4 points on held-out units while the base with the same
        critic gained 5; docs/RESULTS.md); the validation gate decides which one the fleet gets."""
        from fleet.registry import CheckpointRegistry, checkpoint_with_critic

        reg = CheckpointRegistry(self.registry_url)
        v = reg.latest_version()
        current = reg.fetch(v, self.work_dir / "critic_only" / f"v{v:06d}")
        return checkpoint_with_critic(current, self.work_dir / "critic_only" / f"round_{r:03d}", checkpoint)

    def deployed_checkpoint(self, trained: str | Path, r: int) -> str:
        """The ``pretrained_model`` that round ``r`` validates and publishes: ``trained`` itself, or with
        ``learner.wise_alpha`` set its interpolation toward the initial checkpoint
        (``policies.factory.interpolate_checkpoint``, WiSE-FT) in ``<work_dir>/wise/round_<r>``."""
        from policies.factory import deployed_checkpoint

        return deployed_checkpoint(self.lcfg.wise_alpha, self.init_checkpoint, trained, self._wise_dir(r))

    def _wise_dir(self, r: int) -> Path:
        return self.work_dir / "wise" / f"round_{r:03d}"

    def _publish_once(self, checkpoint: str | Path, r: int, out: dict) -> int | None:
        """Publish ``checkpoint`` for round ``r`` unless a version for ``(run_id, r)`` exists already."""
        if not self.publish_versions:
            return None
        from fleet.registry import CheckpointRegistry

        reg = CheckpointRegistry(self.registry_url)
        for v in reversed(reg.versions()):
            md = reg.manifest(v).get("metadata") or {}
            if md.get("run_id") == self.run_id and md.get("round") == r:
                log.info("round %d already published as v%d; not publishing again", r, v)
                return v
        v = reg.publish(checkpoint, metadata={"run_id": self.run_id, "round": r, "step": int(out["step"]),
                                              "kind": "fert", "loss": (out.get("metrics") or {}).get("loss")})
        self.state["published"].append(v)
        return v

    def run(self, rounds: int, should_stop: Callable[[], bool] | None = None) -> dict:
        """Run rounds until ``rounds`` are done (counting rounds finished before a restart); returns status."""
        if 0 < self.state["round"] < rounds:
            log.info("learner %s resumes at round %d", self.run_id, self.state["round"])
        while self.state["round"] < rounds and not (should_stop and should_stop()):
            self.run_round(should_stop)
        import sys

        if "wandb" in sys.modules:  # stop wandb's service now: killed with the actor later, it logs a traceback
            sys.modules["wandb"].teardown()
        return self.status()

    def final_checkpoint(self) -> str | None:
        """``pretrained_model`` directory of the learner's last round (None before round 0): the last training
        checkpoint, or with ``learner.wise_alpha`` set its interpolation toward the initial checkpoint."""
        from policies.aed_diffusion.training import last_checkpoint

        if self.iterative:
            hist = [h for h in self.state.get("history") or [] if h.get("checkpoint")]
            return str(hist[-1]["checkpoint"]) if hist else None
        last = last_checkpoint(self.work_dir / "train")
        if last is None:
            return None
        if self.lcfg.wise_alpha is None:
            return str(last / "pretrained_model")
        r = max(int(self.state["round"]) - 1, 0)   # the round that wrote it, interpolated then (or now)
        wise = self._wise_dir(r)
        return str(wise) if wise.is_dir() else self.deployed_checkpoint(last / "pretrained_model", r)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str | None:
        """The Ray node id (hex) of this learner when it runs as a Ray actor (placed by a resource, e.g. a
        GPU or ``{"learner": 1}``); None in a plain process."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def critic_state_keys(policy) -> list[str]:
    """The observation keys a success critic scores for ``policy``: its state vectors (1-D input shapes), no
    images."""
    return [k for k, shape in policy.config.input_shapes.items() if len(shape) == 1]


def fit_critic_process(store_url: str, episode_ids: list[str], state_keys: list[str], action_dim: int,
                       chunk_steps: int, steps_after_success: int, cfg: dict, seed: int, threads: int,
                       out_dir: str, candidates: int) -> dict:
    """:meth:`FertLearner.start_critic_fit`'s process: ``fleet.fert.critic_fit.fit_critic`` on the episodes
    ``episode_ids`` of the store at ``store_url`` with ``threads`` torch threads on the CPU; the critic is saved
    to ``out_dir`` (``policies.critic.save_critic``). Returns the fit's record with ``fit_s``.

    Raises:
        KeyError: an episode id the store does not hold (the store was replaced under the learner)."""
    import torch

    from experience_dict.store import ExperienceStore
    from fleet.fert.critic_fit import fit_critic
    from policies.critic import save_critic

    torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    reader = ExperienceStore.open(store_url)
    by_id = {m.episode_id: m for m in reader.episodes()}
    critic, rec = fit_critic(reader, [by_id[i] for i in episode_ids], state_keys, action_dim, chunk_steps,
                             steps_after_success, cfg, seed=seed, device="cpu")
    save_critic(critic, out_dir, candidates)
    rec["fit_s"] = time.perf_counter() - t0
    return rec
