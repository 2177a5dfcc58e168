"""FERT data: everything the learner needs per round, in one object (:class:`FertData`).

After "Learning from Fleet Experience" (failure-guided experience retrieval fine-tuning): every failed
episode gives a failure context (the window before its failure onset, :mod:`fleet.fert.failure`); the
context is embedded and searched among windows of *successful* episodes of the same task from the whole
fleet; the retrieved windows (their observations and the actions that followed) become supervision for the
policy's diffusion loss, weighted by similarity and mixed with replay of the demonstrations.

Per FERT round the learner calls (:class:`FertData` bundles these)::

    annotate_failures(reader, W)                       # failure onsets into the store's metadata
    index.refresh(reader)                              # embed + add newly committed successful episodes
    priority.observe(reader)                           # per-task success statistics (learnability)
    contexts = failure_contexts(reader, exclude_units=heldout)
    retrieval = retrieve(index, embed_contexts(reader, index.embedder, contexts), contexts, priority, ...)
    dataset = FertDataset(reader, retrieval, demo_episodes, policy.window_spec(), replay_ratio)

Task priority (which tasks' failures weigh most): :mod:`fleet.fert.priority`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict

import numpy as np

from fleet.fert.config import FertConfig
from fleet.fert.contexts import FailureContext, embed_contexts, failure_contexts
from fleet.fert.dataset import FertDataset
from fleet.fert.failure import (
    DEFAULT_SIGNALS,
    annotate_failures,
    failure_onsets,
    progress_score,
    segment_gain,
)
from fleet.fert.index import SuccessIndex
from fleet.fert.keys import STATE_KEYS, ContextEmbedder, Encoder, RelativeEmbedder
from fleet.fert.priority import TaskPriority
from fleet.fert.retrieve import Retrieval, retrieve


# ----------------------------------------------------------------------------------------- one object
class FertData:
    """Everything the learner needs per FERT round, configured by ``cfg.fert``
    (:class:`fleet.fert.config.FertConfig`).

    Per round::

        fert = FertData(reader, cfg.fert, stats=reader.stats(list(STATE_KEYS), episodes=demos),
                        exclude_units=heldout_units)          # once; keep it across rounds
        fert.update()                     # reader.refresh(), failure onsets, index new successes, task stats
        retrieval = fert.retrieve()       # failure contexts (training units) -> top-k successful windows
        dataset = fert.dataset(retrieval, demos, policy.window_spec(), seed=round_idx)
        train_policy(..., policy=policy, dataset=dataset)     # or DataLoader(dataset, batch_sampler=
                                                              #   FertBatchSampler(dataset, B, n, seed))
        write_retrieval_audit(retrieval, fert.index, out_dir, round_idx)      # fleet.fert.audit

    Args:
        reader: ``ExperienceStore`` reader.
        cfg: a :class:`~fleet.fert.config.FertConfig` or a mapping of its keys (a missing key takes its
            default, e.g. ``key: relative``, ``gate.enabled: true``, ``replay_ratio: 0.25``).
        stats: store statistics of ``embed_keys`` for the state embedding (ignored with ``encoder``).
        exclude_units: units whose episodes are never used, neither as contexts nor as retrieved
            experience nor in the task statistics (the held-out units).
        encoder: optional observation encoder for the embeddings (:func:`policy_encoder`); required when
            ``cfg.encoder == "policy"``.
        aed_key: :func:`aed_history_encoder` output; required when ``cfg.key == "relative+aed"``.

    Raises:
        configs.rules.ConfigError: (a ``ValueError``) an unknown config key or a value out of range.
        ValueError: ``encoder: policy`` without an encoder, ``key: relative+aed`` without ``aed_key``.
    """

    def __init__(self, reader, cfg: Mapping | FertConfig, stats: Mapping | None = None,
                 exclude_units: Iterable[int] = (), encoder: Encoder | None = None,
                 aed_key: tuple[Encoder, float, int] | None = None):
        fc = FertConfig.from_dict(cfg)
        if fc.encoder == "policy" and encoder is None:
            raise ValueError("fert config encoder='policy' needs encoder=policy_encoder(policy)")
        self.reader, self.cfg = reader, fc
        self.exclude_units = [int(u) for u in exclude_units]
        self.window = int(fc.window)
        if fc.key == "relative+aed" and aed_key is None:
            raise ValueError("fert.key='relative+aed' needs aed_key=aed_history_encoder(policy) (a policy with AED)")
        if fc.key in ("relative", "relative+aed"):
            extra, scale, H = aed_key if fc.key == "relative+aed" else (None, 1.0, 0)
            self.embedder = RelativeEmbedder(frames=self.window, stride=fc.frame_stride,
                                             extra=extra, extra_scale=scale, history_actions=H)
        else:   # absolute (FertConfig's rule admits nothing else)
            self.embedder = ContextEmbedder(stats, keys=list(fc.embed_keys or STATE_KEYS),
                                            frames=self.window, stride=fc.frame_stride, pool=fc.pool,
                                            encoder=encoder)
        g = fc.gate
        self.gate = asdict(g) if g.enabled else None
        self.horizon = int(g.horizon or fc.segment_steps)
        sig = fc.onset.signals if fc.onset.progress else {}   # no progress signal: last-window onsets, no gate
        self.signals = DEFAULT_SIGNALS if sig is None else {str(k): (str(v[0]), float(v[1])) for k, v in sig.items()}
        self.index = SuccessIndex(self.embedder, stride=fc.index_stride, include_demos=fc.include_demos,
                                  exclude_units=self.exclude_units, include_retries=fc.include_retries,
                                  gate_horizon=self.horizon if self.gate is not None else None,
                                  tail_steps=int(g.tail_steps or 0) if self.gate is not None else 0,
                                  signals=self.signals, approx_above=fc.approx_above, nprobe=fc.nprobe)
        p = fc.priority
        self.priority = TaskPriority(p.method, p.window, p.floor, exclude_units=self.exclude_units)
        self.tolerance = float(fc.onset.tolerance)
        self.onsets: dict[str, tuple[int, str]] = {}

    def update(self) -> dict[str, int]:
        """``reader.refresh()``, annotate new failures, index new successes, update the task statistics.

        Returns ``{"new_episodes", "annotated", "indexed", "observed"}`` counts of this call."""
        new = self.reader.refresh()
        ann = annotate_failures(self.reader, self.window, self.tolerance, self.signals)
        self.onsets.update(ann)
        # failures another learner annotated first (with its own onset settings): this learner's own onsets
        self.onsets.update(failure_onsets(self.reader, self.window, self.tolerance, self.signals, known=self.onsets))
        return {"new_episodes": int(new), "annotated": len(ann), "indexed": self.index.refresh(self.reader),
                "observed": self.priority.observe(self.reader)}

    def retrieve(self) -> Retrieval:
        """Failure contexts of the training units -> top-k successful windows of the same task."""
        contexts = failure_contexts(self.reader, exclude_units=self.exclude_units, onsets=self.onsets,
                                    max_per_task=self.cfg.max_contexts_per_task)
        if self.gate is not None:
            contexts = [self._with_gain(c) for c in contexts]
        queries = embed_contexts(self.reader, self.embedder, contexts)
        fc = self.cfg
        stage_of = None
        if fc.stage_match:   # an analysis arm: the simulator's stage signals key retrieval (fleet.stages)
            from fleet.stages import StageLookup

            stage_of = StageLookup(self.reader)
        return retrieve(self.index, queries, contexts, self.priority, top_k=fc.top_k, temperature=fc.temperature,
                        min_similarity=fc.min_similarity, gate=self.gate, own_retries_first=fc.own_retries_first,
                        confidence_scale=fc.confidence_scale_m, neighbours=fc.neighbours, stage_of=stage_of)

    def _with_gain(self, c: FailureContext) -> FailureContext:
        """``c`` with ``gain``: the failed episode's progress over the gate horizon after its onset."""
        import dataclasses


        keys = [k for k in self.signals if k in set(self.reader.keys)]
        score = progress_score(self.reader.load_episode(c.episode_id, keys=keys), self.signals) if keys else None
        gain = float(segment_gain(score, np.array([c.onset]), self.horizon)[0]) if score is not None else float("nan")
        return dataclasses.replace(c, gain=gain)

    def dataset(self, retrieval: Retrieval, replay_episodes: Sequence, windows: Mapping,
                seed: int = 0) -> FertDataset:
        """The round's :class:`FertDataset` (``replay_ratio`` and ``weighting`` from the config)."""
        fc = self.cfg
        return FertDataset(self.reader, retrieval, replay_episodes, windows, replay_ratio=fc.replay_ratio,
                           weighting=fc.weighting, seed=seed, replay_all=fc.replay_all,
                           segment_steps=fc.segment_steps)

    def state_dict(self) -> dict:
        """JSON-able learner-checkpoint state: the task statistics. (Onsets live in the store; the index is
        rebuilt from the store by :meth:`update` - keep ``stats`` fixed, e.g. from the demonstrations, so the
        rebuilt embeddings match.)"""
        return {"priority": self.priority.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` output."""
        self.priority.load_state_dict(state["priority"])
