"""The asynchronous FERT learner: trains from the growing store and publishes policy versions.

The learner decides when a round runs, which weights it starts from, whether the validation gate lets its
candidate out, and what it publishes, and keeps its state; what a round learns and how is the algorithm's
(:class:`fleet.fert.algorithm.FertAlgorithm`, ``update``). One round, read top to bottom in
:meth:`FertLearner.run_round`:

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

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experience_dict.atomic import atomic_write_text
from fleet.fert.algorithm import FertAlgorithm
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
        self.algorithm = FertAlgorithm(cfg, store_url, self.init_checkpoint, self.heldout, run_id, self.fcfg, self.lcfg)

    # ------------------------------------------------------------------ state
    def _load_state(self) -> dict:
        if self.state_path.is_file():
            return json.loads(self.state_path.read_text())
        return {"round": 0, "published": [], "rejected": [], "episodes_seen": 0, "history": []}

    def status(self) -> dict:
        """JSON-able: round cursor, published versions, per-round history."""
        return json.loads(json.dumps(self.state))

    # ------------------------------------------------------------------ data
    def _setup(self) -> None:
        self.algorithm.setup()

    def _n_fleet_episodes(self) -> int:
        reader = self.algorithm.reader
        reader.refresh()
        return len([m for m in reader.episodes(is_demo=False) if int(m.unit_id) not in self.heldout])

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
        retrieved segments and per-task replay (``FertAlgorithm.round_dataset``): each round's version improves on the
        last, and the validation gate compares the policies alone (K = 1)."""
        self._setup()
        r = int(self.state["round"])
        n_eps = self._wait_for_data(should_stop)
        if self.iterative:
            return self._run_iterative_round(r, n_eps)
        from fleet.fert.audit import write_retrieval_audit
        from policies.aed_diffusion.training import train_policy
        from policies.factory import load_policy

        alg = self.algorithm
        t0 = time.perf_counter()
        upd = alg.data.update()
        retrieval = alg.data.retrieve()
        policy = load_policy(self.init_checkpoint).train()
        tok_range = alg.tokenizer_range(policy)
        demos = alg.replay_episodes()
        round_seed = 1000 * self.lcfg.seed + r
        dataset = alg.data.dataset(retrieval, demos, policy.window_spec(), seed=round_seed)
        out = train_policy(alg.train_cfg(round_seed, (r + 1) * int(self.lcfg.updates_per_version)),
                           self.work_dir / "train", policy=policy, dataset=dataset, device=str(self.lcfg.device))
        ckpt = self.deployed_checkpoint(out["checkpoint"], r)
        critic = alg.fit_critic(ckpt, policy, round_seed)
        audit = None
        if self.fcfg.audit and len(retrieval):
            audit = write_retrieval_audit(retrieval, alg.data.index, self.work_dir / "audits", r,
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
        """One round of the ``published`` mode (see :meth:`run_round`): the algorithm's update from
        :meth:`round_init_checkpoint`, then the gate and the publication."""
        from fleet.registry import checkpoint_with_critic

        t0 = time.perf_counter()
        init = self.round_init_checkpoint()
        rdir = self.work_dir / "rounds" / f"round_{r:03d}"
        res = self.algorithm.update(init, r, 1000 * self.lcfg.seed + r, rdir, self.work_dir / "audits")
        ckpt, out, retrieval, times = res["checkpoint"], res["train"], res["retrieval"], res["record"]["times"]
        validation, chosen = None, "finetuned"
        candidates = {"finetuned": ckpt}
        if self.validator is not None and self.publish_versions:
            t = time.perf_counter()
            alone = checkpoint_with_critic(ckpt, rdir / "policy_alone", None)
            name, validation = self.validator({"finetuned": alone}, r, policy_alone=True)
            times["validation_s"] = time.perf_counter() - t
            if name is None:   # rejected: the fleet keeps the current weights, with the new critic
                self.state.setdefault("rejected", []).append(r)
                chosen = "critic_only" if res["has_critic"] else None
                if chosen:
                    candidates["critic_only"] = checkpoint_with_critic(self.current_checkpoint(), rdir / "critic_only",
                                                                       ckpt)
        version = self._publish_once(candidates[chosen], r, out) if chosen else None
        rec = {"validation": validation, "round": r, "version": version, "init": init,
               "published_candidate": chosen if version is not None else None, "step": int(out["step"]),
               "fleet_episodes": n_eps, **res["record"], "train_s": time.perf_counter() - t0}
        return self._finish_round(r, n_eps, rec, retrieval)

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
        from fleet.lineage import lineage

        v = reg.publish(checkpoint, metadata={"run_id": self.run_id, "round": r, "step": int(out["step"]),
                                              "kind": "fert", "loss": (out.get("metrics") or {}).get("loss"),
                                              **lineage(self.store_url, reg.latest_version(), self.cfg.get("obs"))})
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


