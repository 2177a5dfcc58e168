"""One FERT round's retrieval: per failure context, its top-k successful windows of the same task.

After "Learning from Fleet Experience" (failure-guided experience retrieval fine-tuning): the context's key is
searched among windows of successful episodes from the whole fleet (:class:`fleet.fert.index.SuccessIndex`);
neighbours are weighted by the context's task priority and a softmax over similarity, gated by progress.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fleet.fert.contexts import FailureContext
from fleet.fert.failure import progress_advantage
from fleet.fert.index import Neighbor, SuccessIndex
from fleet.fert.priority import TaskPriority


# ----------------------------------------------------------------------------------------- retrieval
@dataclass
class Retrieval:
    """One FERT round's retrieval: failure contexts and, per context, its top-k successful windows.

    Per entry (a retrieved window): ``context`` (index into ``contexts``), ``episode_id``/``step`` of the
    successful window's anchor, ``similarity`` (cosine), and ``weight`` = context priority x softmax of the
    context's similarities at ``temperature``; entry weights sum to 1 over the round (less with
    ``retrieve(confidence_scale=...)``: the mass of far contexts goes to replay).
    """
    contexts: list[FailureContext]
    context_weight: np.ndarray           # (C,) float64, sums to 1 over the contexts that retrieved (less: confidence)
    context: np.ndarray                  # (N,) int64
    episode_id: list[str]
    step: np.ndarray                     # (N,) int64
    similarity: np.ndarray               # (N,) float32
    weight: np.ndarray                   # (N,) float64
    source_unit: np.ndarray              # (N,) int64
    source_task: list[str]
    query: np.ndarray | None = None      # (C, E) context embeddings (for the audit)
    distance: np.ndarray | None = None   # (N,) key distance (metres for the relative key; 1 - cos for the absolute)
    gain: np.ndarray | None = None       # (N,) progress gain of the entry's segment (nan: unknown)
    own_retry: np.ndarray | None = None  # (N,) bool: the entry comes from its context's own successful retry

    def __len__(self) -> int:
        return len(self.episode_id)

    def to_json(self) -> dict:
        """JSON-able record (without embeddings)."""
        n = len(self.episode_id)
        dist = self.distance if self.distance is not None else np.full(n, np.nan)
        gain = self.gain if self.gain is not None else np.full(n, np.nan)
        own = self.own_retry if self.own_retry is not None else np.zeros(n, bool)
        nan = lambda x: None if not np.isfinite(x) else float(x)
        return {"contexts": [{k: (nan(v) if isinstance(v, float) else v) for k, v in c.__dict__.items()}
                             for c in self.contexts],
                "context_weight": self.context_weight.tolist(),
                "entries": [{"context": int(c), "episode_id": e, "step": int(s), "similarity": float(q),
                             "weight": float(w), "unit_id": int(u), "distance": nan(d), "gain": nan(g),
                             "own_retry": bool(o)}
                            for c, e, s, q, w, u, d, g, o in zip(self.context, self.episode_id, self.step,
                                                                 self.similarity, self.weight, self.source_unit,
                                                                 dist, gain, own)]}


def softmax_weights(sims: np.ndarray, temperature: float) -> np.ndarray:
    """Softmax of cosine similarities at ``temperature`` (> 0; small = sharper). (k,) -> (k,) sum 1."""
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, given {temperature}")
    z = (np.asarray(sims, np.float64) - np.max(sims)) / temperature
    e = np.exp(z)
    return e / e.sum()


def retrieve(index: SuccessIndex, queries: np.ndarray, contexts: Sequence[FailureContext],
             priority: TaskPriority | None = None, top_k: int = 8, temperature: float = 0.1,
             min_similarity: float | None = None, gate: Mapping | None = None,
             own_retries_first: bool = True, confidence_scale: float | None = None,
             neighbours: str = "fleet", stage_of=None) -> Retrieval:
    """Top-k successful windows of the same task for every failure context, with sampling weights.

    Candidates per context: the nearest window of each of its own successful retries first (same task, unit
    and reset seed, re-attempted with exploration; ``own_retries_first``), then the nearest windows of the
    task's index over the whole fleet. With ``neighbours="own_retries"`` only the own successful retries are
    candidates: a failure is supervised by the exploration that recovered it, and a failure that no retry
    recovered retrieves nothing (its share goes to the replay), so no far-away fleet success supervises it.
    With ``gate`` (``{"min_gain", "beta", "max_weight"}``,
    :func:`fleet.fert.failure.progress_advantage`), a candidate whose segment does not make more progress
    than the failure did after its onset is dropped, and the survivors are weighted by
    ``exp(advantage / beta)``; without it, by ``softmax(similarity / temperature)``.

    Context weight: ``P(task) * P(context | task)`` with ``P(task)`` from ``priority`` (uniform without one)
    over the tasks that have contexts and retrieved windows, and ``P(context | task) ∝ 2 ** -(v_max - v)``
    (``v`` the context's policy version, ``v_max`` the newest of the task). Entry weight: context weight x
    the context's normalised candidate weights.

    With ``confidence_scale`` (``sigma``, in key-distance units: metres for the relative key), every context
    weight is further multiplied by its *confidence* ``exp(-d^2 / (2 sigma^2))``, ``d`` the mean key distance of
    its kept neighbours, and the weights are **not** renormalised: a context whose nearest successes are far
    from its state (no nearby experience to imitate) keeps little weight, and the mass it loses goes to the
    demonstration replay (the retrieved windows' mean ``sample_weight`` drops below the replay's 1). This is a
    Gaussian kernel on the neighbour distance, as in kernel regression (Nadaraya 1964; Watson 1964): the
    supervision a far neighbour gives is an extrapolation.

    Args:
        index: the success index; queries are searched only within their context's task.
        queries: (C, E) embeddings of ``contexts`` (:func:`embed_contexts`).
        contexts: the C failure contexts (``gain`` set when ``gate`` is used).
        priority: task priority; None = uniform over tasks.
        top_k: neighbours kept per context (>= 1).
        temperature: softmax temperature over similarities (> 0).
        min_similarity: drop neighbours below this similarity (cosine; ``-metres`` for the L2 key).
        gate: progress gate settings, or None for no gate.
        own_retries_first: put the context's own successful retries first.
        confidence_scale: kernel width ``sigma`` of the context confidence (> 0), or None for confidence 1.
        neighbours: ``"fleet"`` (own retries, then the whole fleet's index) or ``"own_retries"`` (only them).
        stage_of: ``f(episode_id, task, step) -> stage or None`` (``fleet.stages.StageLookup``; ``fert.stage_match``):
            a context keeps only candidates whose anchor is at its own stage at its onset (searched among 16 x
            ``top_k``); None, or a task without stages: no stage key.

    Raises:
        ValueError: ``len(queries) != len(contexts)`` or bad ``top_k``/``temperature``/gate/``confidence_scale``/
            ``neighbours`` values.
    """

    if len(queries) != len(contexts):
        raise ValueError(f"queries: expected {len(contexts)} rows (one per context), given {len(queries)}")
    if top_k < 1:
        raise ValueError(f"top_k: expected >= 1, given {top_k}")
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, given {temperature}")
    if neighbours not in ("fleet", "own_retries"):
        raise ValueError(f"neighbours: expected 'fleet' or 'own_retries', given {neighbours!r}")
    if confidence_scale is not None and not confidence_scale > 0:
        raise ValueError(f"confidence_scale: expected > 0 (key-distance units) or None, given {confidence_scale}")
    by_task: dict[str, list[int]] = {}
    for i, c in enumerate(contexts):
        by_task.setdefault(c.task, []).append(i)
    neigh: list[list[Neighbor]] = [[] for _ in contexts]
    cand_w: list[np.ndarray] = [np.zeros(0) for _ in contexts]
    oversample = (4 if gate is not None else 1) * (16 if stage_of is not None else 1)
    for task, idx in by_task.items():
        for i, nb in zip(idx, index.search(task, queries[idx], top_k * oversample)):
            own_only = neighbours == "own_retries"
            own = index.own_retries(contexts[i].episode_id, queries[i]) if (own_retries_first or own_only) else []
            seen = {(n.episode_id, n.step) for n in own}
            cand = own + ([] if own_only else [n for n in nb if (n.episode_id, n.step) not in seen])
            cand = [n for n in cand if min_similarity is None or n.similarity >= min_similarity]
            stage = stage_of(contexts[i].episode_id, task, contexts[i].onset) if stage_of is not None else None
            if stage is not None:    # fert.stage_match: only windows at the stage the failure had reached
                cand = [n for n in cand if stage_of(n.episode_id, task, n.step) == stage]
            if gate is not None:
                gains = np.array([n.gain for n in cand], np.float64)
                fail_gain = contexts[i].gain if np.isfinite(contexts[i].gain) else 0.0
                passed, w = progress_advantage(np.nan_to_num(gains, nan=np.inf), fail_gain,
                                               float(gate.get("min_gain", 0.02)), float(gate.get("beta", 0.05)),
                                               float(gate.get("max_weight", 20.0)))
                w = np.where(np.isnan(gains), 1.0, w)      # no progress signal: ungated, weight 1
                keep = [j for j in range(len(cand)) if passed[j] or np.isnan(gains[j])][:top_k]
                neigh[i], cand_w[i] = [cand[j] for j in keep], w[keep]
            else:
                neigh[i] = cand[:top_k]
                cand_w[i] = softmax_weights([n.similarity for n in neigh[i]], temperature) if neigh[i] else np.zeros(0)
    tasks = sorted({contexts[i].task for i in range(len(contexts)) if neigh[i]})
    p_task = dict(zip(tasks, priority.probs(tasks) if priority is not None else np.full(len(tasks), 1 / max(len(tasks), 1))))
    cw = np.zeros(len(contexts), np.float64)
    for task in tasks:
        idx = [i for i in by_task[task] if neigh[i]]
        v = np.array([contexts[i].policy_version for i in idx], np.float64)
        w = 2.0 ** -(v.max() - v)
        cw[idx] = p_task[task] * w / w.sum()
    if confidence_scale is not None:
        for i in range(len(contexts)):
            d = np.array([n.distance for n in neigh[i]], np.float64)
            d = d[np.isfinite(d)]
            if len(d):
                cw[i] *= float(np.exp(-d.mean() ** 2 / (2.0 * float(confidence_scale) ** 2)))
    rows = [(i, n, cw[i] * sw) for i in range(len(contexts)) if neigh[i]
            for n, sw in zip(neigh[i], cand_w[i] / cand_w[i].sum())]
    metas = index.meta
    return Retrieval(
        contexts=list(contexts), context_weight=cw,
        context=np.array([r[0] for r in rows], np.int64),
        episode_id=[r[1].episode_id for r in rows],
        step=np.array([r[1].step for r in rows], np.int64),
        similarity=np.array([r[1].similarity for r in rows], np.float32),
        weight=np.array([r[2] for r in rows], np.float64),
        source_unit=np.array([int(metas[r[1].episode_id].unit_id) for r in rows], np.int64),
        source_task=[metas[r[1].episode_id].task for r in rows],
        query=np.asarray(queries, np.float32),
        distance=np.array([r[1].distance for r in rows], np.float32),
        gain=np.array([r[1].gain for r in rows], np.float32),
        own_retry=np.array([r[1].own_retry for r in rows], bool))


