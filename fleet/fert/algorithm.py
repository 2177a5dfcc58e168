"""One FERT round's learning, kept apart from the learner's waiting, publishing and state.

After LeRobot's ``rl/algorithms/base.py`` (an algorithm object with ``update``) and its trainer: the
:class:`FertAlgorithm` owns what a round learns from the store and how (failure contexts and retrieval, the
success critic's fit, the distillation's candidates and targets, the round's mix of training windows, the
fine-tuning, the audit) and :meth:`FertAlgorithm.update` runs one round of it from a given checkpoint into a
candidate checkpoint. :class:`fleet.fert.learner.FertLearner` decides when a round runs (waiting for new fleet
episodes), which weights it starts from, whether the validation gate lets the candidate out, what it publishes,
and keeps the state that survives a restart.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from fleet.fert.config import FertConfig
from fleet.fert.learner_config import LearnerConfig

log = logging.getLogger(__name__)


class FertAlgorithm:
    """FERT's learning: what one round trains on and how, from a store, for one learner.

    Args:
        cfg: plain dict with ``fert``, ``train``, ``learner``, ``task`` (``steps_after_success``) and ``store``
            (the storage options); the same dict the learner gets.
        store_url: the fleet's experience store.
        init_checkpoint: ``pretrained_model`` directory of the loop's initial weights (the base): the AED key's
            encoder (``fert.key: relative+aed``) and WiSE-FT's anchor.
        heldout: held-out unit ids, never used for training.
        run_id: names this algorithm's log lines.
        fert / learner: the typed ``fert`` and ``learner`` groups (:class:`FertConfig`, :class:`LearnerConfig`).
    """

    def __init__(self, cfg: dict, store_url: str, init_checkpoint: str, heldout: list[int], run_id: str,
                 fert: FertConfig, learner: LearnerConfig):
        self.cfg, self.store_url, self.init_checkpoint = cfg, store_url, str(init_checkpoint)
        self.heldout, self.run_id = [int(u) for u in heldout], run_id
        self.fcfg, self.lcfg = fert, learner
        self.data = None      # fleet.fert.data.FertData, made by setup()
        self.reader = None    # the store's reader, made by setup()
        self._range_seen: set[str] = set()   # fleet episodes whose actions tokenizer_range has counted

    @property
    def steps_after_success(self) -> int:
        """Steps a successful episode runs past its first success (``task.steps_after_success``; its default is
        ``configs.sim_groups.TaskConfig``'s, the one the envs use)."""
        from configs.sim_groups import TaskConfig

        return int((self.cfg.get("task") or {}).get("steps_after_success", TaskConfig.steps_after_success))

    def setup(self) -> None:
        """Open the store and build the round's data (:class:`fleet.fert.data.FertData`); once.

        Raises:
            RuntimeError: the store holds no demonstrations to replay."""
        if self.data is not None:
            return
        from experience_dict.store import configure_storage
        from fleet.fert.data import FertData
        from fleet.labels import learner_reader

        configure_storage({**dict(self.cfg.get("store") or {}), "url": self.store_url})
        self.reader = learner_reader(self.store_url, self.cfg.get("labels"))   # labels.trust_margin's view
        demos = self.reader.episodes(is_demo=True)
        if not demos:
            raise RuntimeError(f"store {self.store_url!r} holds no demonstrations to replay")
        stats = self.reader.stats(["observation.state", "observation.environment_state"], episodes=demos)
        fert_cfg = self.fcfg
        if fert_cfg.gate.tail_steps is None:   # the steps a successful episode runs on after its first success
            tail = self.steps_after_success
            fert_cfg = dataclasses.replace(fert_cfg, gate=dataclasses.replace(fert_cfg.gate, tail_steps=tail))
        aed_key = None
        if fert_cfg.key == "relative+aed":   # the key's AED part: the (fixed) initial policy's dictionary
            from fleet.fert.keys import aed_history_encoder
            from policies.factory import load_policy

            self._key_policy = load_policy(self.init_checkpoint)
            aed_key = aed_history_encoder(self._key_policy, float(fert_cfg.aed_key_scale_m))
        self.data = FertData(self.reader, fert_cfg, stats=stats, exclude_units=self.heldout, aed_key=aed_key)


    def update(self, init: str, r: int, seed: int, out_dir: Path, audit_dir: Path) -> dict:
        """One round of the ``published`` mode (``learner.round_init: published`` or ``base``) from the weights
        ``init``: retrieval for the store's failure contexts, the success critic fitted (in its own process on the
        CPU) while the policy samples the distillation's candidates, the round's mix of training windows
        (:meth:`round_dataset`), fine-tuning, WiSE-FT toward the initial weights (``learner.wise_alpha``), the
        checkpoint with its critic, and the retrieval audit. Nothing is published or gated here.

        Returns:
            ``{"checkpoint": the candidate pretrained_model (with its critic, when fitted), "has_critic",
            "retrieval", "train": train_policy's output, "record": the round's learning record}``.
        """
        from fleet.fert.audit import write_retrieval_audit
        from fleet.registry import checkpoint_with_critic
        from policies.aed_diffusion.training import train_policy
        from policies.critic import save_critic
        from policies.factory import deployed_checkpoint, load_policy

        self.setup()
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        upd = self.data.update()
        retrieval = self.data.retrieve()
        times["retrieval_s"] = time.perf_counter() - t0
        policy = load_policy(init)
        tok_range = self.tokenizer_range(policy)
        # the critic is fitted in a process of its own while this one samples the policy's candidate chunks for
        # the distillation (neither needs the other; one thread each, so the 2-core machine's second core works)
        t = time.perf_counter()
        finish_critic = self.start_critic_fit(policy, seed, out_dir / "critic_fit")
        sampled = None
        if self.distill_on():
            sampled = self.distill_candidates(policy.eval(), seed)
            times["candidates_s"] = time.perf_counter() - t
        critic, crit_rec, candidates_k = finish_critic()
        times["critic_s"] = time.perf_counter() - t   # the fit, and the candidates' sampling beside it
        t = time.perf_counter()
        dataset, mix = self.round_dataset(retrieval, policy.eval(), critic, candidates_k, seed, sampled=sampled)
        times["distill_s"] = time.perf_counter() - t
        t = time.perf_counter()
        out = train_policy(self.train_cfg(seed, int(self.lcfg.updates_per_version)), out_dir / "train",
                           policy=policy.train(), dataset=dataset, device=str(self.lcfg.device))
        times["train_s"] = time.perf_counter() - t
        ckpt = deployed_checkpoint(self.lcfg.wise_alpha, init, out["checkpoint"], out_dir / "wise")
        ckpt = checkpoint_with_critic(ckpt, out_dir / "policy", None)   # the round's weights, without any critic
        if critic is not None:
            save_critic(critic, ckpt, candidates_k)
        audit = None
        if self.fcfg.audit and len(retrieval):
            audit = write_retrieval_audit(retrieval, self.data.index, audit_dir, r, tokenizer_range=tok_range)
        record = {"contexts": len(retrieval.contexts), "retrieved": len(retrieval), "dataset": len(dataset),
                  "mix": mix, "update": upd, "loss": (out.get("metrics") or {}).get("loss"),
                  "train_s": time.perf_counter() - t0, "times": times, "audit": (audit or {}).get("files"),
                  "critic": crit_rec, "checkpoint": str(ckpt), "tokenizer_range": tok_range}
        return {"checkpoint": ckpt, "has_critic": critic is not None, "retrieval": retrieval, "train": out,
                "record": record}

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
        new = [m for m in self.reader.episodes(is_demo=False)
               if int(m.unit_id) not in self.heldout and m.episode_id not in self._range_seen]
        rep = tok.range_report([self.reader.load_episode(m.episode_id, ["action"])["action"] for m in new])
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
        demos = self.reader.episodes(is_demo=True)
        if mode == "demos":
            return demos
        retries = bool(self.fcfg.include_retries)
        ids = {m.episode_id for m in demos}
        fleet = [m for m in self.reader.episodes(success=True) if m.episode_id not in ids
                 and int(m.unit_id) not in self.heldout and (retries or not retry_of(m))]
        return demos + fleet

    def train_cfg(self, seed: int, steps: int) -> dict:
        return {**dict(self.cfg.get("train") or {}), "seed": seed, "steps": int(steps), "resume": True,
                "lr": float(self.lcfg.lr), "warmup_steps": int(self.lcfg.warmup_steps),
                "batch_size": int(self.lcfg.batch_size), "save_every": int(self.lcfg.updates_per_version),
                # the learner's own thread count (learner.torch_threads), not the base training's train.num_threads
                **({"num_threads": int(self.lcfg.torch_threads)} if self.lcfg.torch_threads else {}),
                "progress": False, "wandb": {**dict((self.cfg.get("train") or {}).get("wandb") or {}),
                                             "name": f"learner-{self.run_id}"}}

    def distill_on(self) -> bool:
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
        windows = WindowDataset(self.reader, self.critic_episodes(), windows=policy.window_spec())
        anchors = balanced_anchors(windows, fc.distill.states_per_task, seed)
        return sample_candidates(policy, windows, anchors, fc.critic.candidates, critic_state_keys(policy), seed,
                                 fc.distill.batch_size, features=critic_features(policy, fc.critic.images))

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
            parts.append(("retrieved", FertDataset(self.reader, retrieval, [], spec, replay_ratio=0.0,
                                                   weighting=self.fcfg.weighting, seed=seed,
                                                   segment_steps=self.fcfg.segment_steps),
                          shares["retrieved"]))
        rec: dict = {}
        if critic is not None and candidates > 1 and self.distill_on():   # the same rule the round sampled by
            if sampled is None:
                sampled = self.distill_candidates(policy, seed)
            targets, rec["distill"] = choose_targets(critic, sampled)
            parts.append(("distill", targets, shares["distill"]))
        ok = self.replay_episodes(mode="successes")
        tasks = sorted({m.task for m in ok})
        for task in tasks:
            parts.append((f"replay:{task}", WindowDataset(self.reader, [m for m in ok if m.task == task], windows=spec),
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
        return [m for m in self.reader.episodes() if int(m.unit_id) not in self.heldout
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
        feats = critic_features(policy, ccfg.images)
        args = (self.store_url, [m.episode_id for m in self.critic_episodes()], keys, int(policy.config.action_dim),
                int(policy.config.n_action_steps), self.steps_after_success,
                dataclasses.asdict(ccfg), int(seed), int(self.lcfg.torch_threads or torch.get_num_threads()),
                str(out_dir), ccfg.candidates,
                (feats.spec(), {k: v.cpu() for k, v in feats.state_dict().items()}))
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
        critic, rec = fit_critic(self.reader, self.critic_episodes(), keys, int(policy.config.action_dim),
                                 int(policy.config.n_action_steps),
                                 self.steps_after_success,
                                 dataclasses.asdict(ccfg), seed=seed, device=resolve_device(str(self.lcfg.device)),
                                 features=critic_features(policy, ccfg.images))
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


def critic_state_keys(policy) -> list[str]:
    """The state vectors a success critic scores for ``policy``: its 1-D input shapes (cameras:
    :func:`critic_features`)."""
    return [k for k, shape in policy.config.input_shapes.items() if len(shape) == 1]


def critic_features(policy, images: bool = True):
    """What a success critic sees of ``policy``'s frames (``policies.critic.CriticFeatures``): its state vectors
    and, with ``images`` (``fert.critic.images``), its cameras through a frozen copy of its image encoder."""
    from policies.critic import CriticFeatures

    return CriticFeatures.from_policy(policy, images=images)


def fit_critic_process(store_url: str, episode_ids: list[str], state_keys: list[str], action_dim: int,
                       chunk_steps: int, steps_after_success: int, cfg: dict, seed: int, threads: int,
                       out_dir: str, candidates: int, images: tuple | None = None) -> dict:
    """:meth:`FertAlgorithm.start_critic_fit`'s process: ``fleet.fert.critic_fit.fit_critic`` on the episodes
    ``episode_ids`` of the store at ``store_url`` with ``threads`` torch threads on the CPU; the critic is saved
    to ``out_dir`` (``policies.critic.save_critic``). ``images``: ``(CriticFeatures.spec(), the frozen encoders'
    state dict)`` of :func:`critic_features` (None: state vectors only). Returns the fit's
    record with ``fit_s``.

    Raises:
        KeyError: an episode id the store does not hold (the store was replaced under the learner)."""
    import torch

    from experience_dict.store import ExperienceStore
    from fleet.fert.critic_fit import fit_critic
    from policies.critic import CriticFeatures, save_critic

    torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    reader = ExperienceStore.open(store_url)
    by_id = {m.episode_id: m for m in reader.episodes()}
    feats = CriticFeatures(state_keys)
    if images:
        feats = CriticFeatures(**images[0])
        feats.load_state_dict(images[1])
    critic, rec = fit_critic(reader, [by_id[i] for i in episode_ids], state_keys, action_dim, chunk_steps,
                             steps_after_success, cfg, seed=seed, device="cpu", features=feats.eval())
    save_critic(critic, out_dir, candidates)
    rec["fit_s"] = time.perf_counter() - t0
    return rec
