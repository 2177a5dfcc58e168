"""Failure contexts: the window before each failed episode's failure onset, the query of FERT's retrieval.

Failure onsets come from :mod:`fleet.fert.failure`; a retry of a failed episode names it in
``meta.extra["retry_of"]`` (:func:`retry_of`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fleet.fert.keys import ContextEmbedder


def retry_of(meta) -> str | None:
    """The failed episode id a retry episode re-attempted (``meta.extra["retry_of"]``), else None."""
    extra = getattr(meta, "extra", None) or {}
    return extra.get("retry_of") if isinstance(extra, Mapping) else None


# ----------------------------------------------------------------------------------------- contexts
@dataclass(frozen=True)
class FailureContext:
    """A failed episode's failure context: the embedder's window ending at ``onset`` (step, inclusive)."""
    episode_id: str
    task: str
    unit_id: int
    policy_version: int
    onset: int
    gain: float = float("nan")    # progress the failed episode made over the gate horizon after its onset


def commit_order(m) -> tuple[int, int, int, str]:
    """A deterministic "oldest first" order of episodes: ``(policy_version, the shard's commit counter, unit,
    episode id)``. Within a policy version the units' n-th commits come before their (n+1)-th, as when the units
    run side by side. Wall-clock ``start_time`` is not used: across runs of one seed it orders the same
    episodes differently (units race), which changed the task priority, the failure contexts kept and their
    order, and so the round's training data (the run-to-run differences of experiment 29)."""
    eid = str(m.episode_id)
    tail = eid.rsplit("-", 1)[-1]
    return int(m.policy_version), int(tail) if tail.isdigit() else 0, int(m.unit_id), eid


def failure_contexts(reader, exclude_units: Iterable[int] = (), units: Iterable[int] | None = None,
                     onsets: Mapping[str, int | tuple[int, str]] | None = None,
                     max_per_task: int | None = None, **filters) -> list[FailureContext]:
    """Failure contexts of the failed, non-demo episodes that have a failure onset.

    Args:
        reader: store reader.
        exclude_units / units: unit filters (exclude the held-out units here).
        onsets: ``{episode_id: onset or (onset, method)}`` overriding ``meta.failure_onset`` (e.g. the
            return value of :func:`annotate_failures` when the reader snapshot predates the update).
        max_per_task: keep only the newest (``commit_order``: highest ``policy_version``, then the latest
            commits) contexts per task.
        **filters: passed to ``reader.episodes``.

    Returns:
        contexts, newest first within each task. Episodes without an onset are skipped, and so are failed
        exploration retries (``extra.retry_of``): they are failures of the exploration, not of the policy.
    """
    excl, keep = {int(u) for u in exclude_units}, None if units is None else {int(u) for u in units}
    onsets = onsets or {}
    by_task: dict[str, list[FailureContext]] = {}
    for m in reader.episodes(success=False, is_demo=False, **filters):
        if int(m.unit_id) in excl or (keep is not None and int(m.unit_id) not in keep) or retry_of(m):
            continue  # a failed exploration retry is not a failure of the policy
        onset = onsets.get(m.episode_id, m.failure_onset)
        if isinstance(onset, (tuple, list)):
            onset = onset[0]
        if onset is None:
            continue
        by_task.setdefault(m.task, []).append(
            (FailureContext(m.episode_id, m.task, int(m.unit_id), int(m.policy_version), int(onset)),
             commit_order(m)))
    out = []
    for task in sorted(by_task):
        ctx = [c for c, _ in sorted(by_task[task], key=lambda ck: ck[1], reverse=True)]
        out.extend(ctx[:max_per_task] if max_per_task else ctx)
    return out


def embed_contexts(reader, embedder: ContextEmbedder, contexts: Sequence[FailureContext]) -> np.ndarray:
    """(N, E) float32 embeddings of the failure contexts (window ending at each onset)."""
    out = []
    for c in contexts:
        data = reader.load_episode(c.episode_id, keys=list(embedder.keys))
        T = len(data[embedder.keys[0]])
        if not 0 <= c.onset < T:
            raise ValueError(f"episode {c.episode_id!r}: failure onset {c.onset} outside [0, {T})")
        out.append(embedder.embed_episode(data, np.array([c.onset])))
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


