"""The faiss index of successful windows, one per task, filled as the fleet commits episodes.

Only windows of successful episodes are ever added (a query cannot return a failed episode's window); held-out
units are never indexed. Each window carries its segment's progress gain (the progress gate's input).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from fleet.fert.contexts import retry_of
from fleet.fert.failure import DEFAULT_SIGNALS, progress_score, segment_gain

logging.getLogger("faiss.loader").setLevel(logging.WARNING)   # its CPU-feature probes log ModuleNotFoundError at INFO
import faiss


# ----------------------------------------------------------------------------------------- index
@dataclass
class _TaskIndex:
    index: faiss.Index
    approx: bool = False                                   # an IVF index (``SuccessIndex.approx_above``)
    episode: list[int] = field(default_factory=list)     # per window: position in SuccessIndex.episode_ids
    step: list[int] = field(default_factory=list)
    gain: list[float] = field(default_factory=list)      # per window: progress gain of its segment (nan: unknown)


@dataclass(frozen=True)
class Neighbor:
    """One retrieved successful window: its episode, anchor step (the window ends there), the similarity used
    for ranking (cosine for the absolute key, ``-distance`` for the L2 key), the key distance (``1 - cos`` for
    the absolute key; metres for the relative key), and the progress gain of its segment (nan: unknown)."""
    episode_id: str
    step: int
    similarity: float
    distance: float = float("nan")
    gain: float = float("nan")
    own_retry: bool = False


class SuccessIndex:
    """faiss index over windows of successful episodes, one flat index per task, filled incrementally:
    inner product (cosine: the absolute key is L2-normalised) or L2 distance, following ``embedder.metric``.

    Only episodes with ``success=True`` are ever added (checked again at insertion), so a query can never
    return a window of a failed episode. Episodes of ``exclude_units`` (the held-out units) are never added.
    With ``gate_horizon``, each window also carries the progress its segment gains
    (:func:`fleet.fert.failure.segment_gain` over ``gate_horizon`` steps) and anchors in the last
    ``tail_steps`` steps of an episode (after its first success, where Meta-World episodes run on for
    ``task.steps_after_success`` steps) are not indexed. Successful retries (``extra.retry_of``) are listed in
    ``retries_of`` so a failure's own successful retries can rank first.

    Args:
        embedder: the :class:`ContextEmbedder` or :class:`RelativeEmbedder` used for windows and contexts.
        stride: index every ``stride``-th step of an episode as a window anchor (>= 1).
        include_demos: also index the (successful) bootstrap demonstrations.
        exclude_units: unit ids never indexed.
        units: if given, only these unit ids are indexed.
        include_retries: index successful failure retries (``extra.retry_of`` set).
        gate_horizon: segment length in steps for the progress gains (None: no gains).
        tail_steps: anchors in the last ``tail_steps`` steps are not indexed (>= 0).
        signals: progress signals for the score (:data:`fleet.fert.failure.DEFAULT_SIGNALS`).
        approx_above: when a task holds this many windows its exact flat index is replaced, once, by an
            inverted-file index (faiss ``IndexIVFFlat``, ``nlist = sqrt(n)`` k-means lists trained on at most
            64 windows per list of those it has; Jegou et al. 2011) and later windows are added to it without retraining; None:
            always exact. Measured on this machine (``scripts/bench_retrieval.py``): at 1M windows exact search
            takes tens of ms per query, IVF probing 32 lists well under 1 ms.
        nprobe: inverted lists probed per query (recall against speed; :meth:`recall` measures it).
    """

    def __init__(self, embedder, stride: int = 1, include_demos: bool = True,
                 exclude_units: Iterable[int] = (), units: Iterable[int] | None = None,
                 include_retries: bool = True, gate_horizon: int | None = None, tail_steps: int = 0,
                 signals: Mapping | None = None, approx_above: int | None = 100_000, nprobe: int = 32):
        if stride < 1 or tail_steps < 0:
            raise ValueError(f"stride: expected >= 1 and tail_steps >= 0, given {stride}, {tail_steps}")
        if approx_above is not None and int(approx_above) < 64:
            raise ValueError(f"approx_above: expected >= 64 windows (k-means needs data) or None, given {approx_above}")
        self.approx_above, self.nprobe = (None if approx_above is None else int(approx_above)), int(nprobe)
        self.embedder, self.stride, self.include_demos = embedder, stride, include_demos
        self.metric = getattr(embedder, "metric", "ip")
        self.exclude_units = {int(u) for u in exclude_units}
        self.units = None if units is None else {int(u) for u in units}
        self.include_retries, self.gate_horizon, self.tail_steps = include_retries, gate_horizon, int(tail_steps)
        self.signals = DEFAULT_SIGNALS if signals is None else signals
        self.tasks: dict[str, _TaskIndex] = {}
        self.episode_ids: list[str] = []
        self.meta: dict[str, object] = {}          # episode_id -> EpisodeMeta of indexed episodes
        self.retries_of: dict[str, list[str]] = {}  # failed episode id -> its indexed successful retries
        self.windows_of: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # episode -> (steps, keys, gains)
        self._pos: dict[str, int] = {}

    def __contains__(self, episode_id: str) -> bool:
        return episode_id in self._pos

    def allowed(self, meta) -> bool:
        """Whether an episode may be indexed (success, unit filters, demos, retries)."""
        return (bool(meta.success) and int(meta.unit_id) not in self.exclude_units
                and (self.units is None or int(meta.unit_id) in self.units)
                and (self.include_demos or not meta.is_demo)
                and (self.include_retries or not retry_of(meta)))

    def _keys(self) -> list[str]:
        keys = list(self.embedder.keys)
        if self.gate_horizon:
            keys += [k for k in self.signals if k not in keys]
        return keys

    def add_episode(self, meta, data: Mapping[str, np.ndarray]) -> int:
        """Index one successful episode's windows; returns the number of windows added.

        Raises:
            ValueError: the episode is not successful / not allowed, or was already indexed.
        """

        if not meta.success:
            raise ValueError(f"episode {meta.episode_id!r}: only successful episodes are indexed (success=False)")
        if not self.allowed(meta):
            raise ValueError(f"episode {meta.episode_id!r}: unit {meta.unit_id} / is_demo={meta.is_demo} "
                             "excluded from the index")
        if meta.episode_id in self._pos:
            raise ValueError(f"episode {meta.episode_id!r}: already indexed")
        T = int(meta.length)
        anchors = np.arange(0, max(T - self.tail_steps, 1), self.stride, dtype=np.int64)
        z = self.embedder.embed_episode(data, anchors)
        gains = np.full(len(anchors), np.nan)
        if self.gate_horizon:
            score = progress_score({k: v for k, v in data.items() if k in self.signals}, self.signals)
            if score is not None:
                gains = segment_gain(score, anchors, int(self.gate_horizon))
        ti = self.tasks.get(meta.task)
        if ti is None:
            make = faiss.IndexFlatL2 if self.metric == "l2" else faiss.IndexFlatIP
            ti = self.tasks[meta.task] = _TaskIndex(make(z.shape[1]))
        if z.shape[1] != ti.index.d:
            raise ValueError(f"embedding dim {z.shape[1]} != index dim {ti.index.d} for task {meta.task!r}")
        pos = self._pos[meta.episode_id] = len(self.episode_ids)
        self.episode_ids.append(meta.episode_id)
        self.meta[meta.episode_id] = meta
        self.windows_of[meta.episode_id] = (anchors, z, gains)
        if retry_of(meta):
            self.retries_of.setdefault(retry_of(meta), []).append(meta.episode_id)
        ti.index.add(z)
        ti.episode.extend([pos] * len(anchors))
        ti.step.extend(anchors.tolist())
        ti.gain.extend(gains.tolist())
        if not ti.approx and self.approx_above is not None and ti.index.ntotal >= self.approx_above:
            self._to_ivf(ti)
        return len(anchors)

    def _metric(self) -> int:
        return faiss.METRIC_L2 if self.metric == "l2" else faiss.METRIC_INNER_PRODUCT

    def _to_ivf(self, ti: _TaskIndex) -> None:
        """Replace ``ti``'s exact index by an IVF index over the same windows, in the same order."""
        x = ti.index.reconstruct_n(0, ti.index.ntotal)
        nlist = max(1, int(np.sqrt(len(x))))
        quantizer = faiss.IndexFlatL2(x.shape[1]) if self.metric == "l2" else faiss.IndexFlatIP(x.shape[1])
        ivf = faiss.IndexIVFFlat(quantizer, x.shape[1], nlist, self._metric())
        rng = np.random.default_rng(0)
        sample = x if len(x) <= 64 * nlist else x[rng.choice(len(x), 64 * nlist, replace=False)]
        ivf.train(np.ascontiguousarray(sample))
        ivf.add(x)
        ivf.nprobe = min(self.nprobe, nlist)
        ti.index, ti.approx = ivf, True

    def task_vectors(self, task: str) -> np.ndarray:
        """(n, E) float32: every indexed window embedding of ``task``, in index order."""
        ti = self.tasks[task]
        order = list(dict.fromkeys(ti.episode))
        return np.concatenate([self.windows_of[self.episode_ids[p]][1] for p in order]).astype(np.float32)

    def recall(self, task: str, queries: np.ndarray, k: int = 8) -> float:
        """recall@k of ``task``'s index against exact search for ``queries`` (N, E): the mean share of the
        exact top-k windows the index returns (1.0 for an exact index)."""
        ti = self.tasks.get(task)
        if ti is None or not ti.approx or len(queries) == 0:
            return 1.0
        q = np.ascontiguousarray(np.asarray(queries, np.float32).reshape(len(queries), -1))
        exact = faiss.IndexFlatL2(q.shape[1]) if self.metric == "l2" else faiss.IndexFlatIP(q.shape[1])
        exact.add(self.task_vectors(task))
        kk = min(k, ti.index.ntotal)
        _, want = exact.search(q, kk)
        _, got = ti.index.search(q, kk)
        return float(np.mean([len(set(w) & set(g)) / kk for w, g in zip(want, got)]))

    def refresh(self, reader, tasks: Iterable[str] | None = None) -> int:
        """Add every committed successful episode not indexed yet (call ``reader.refresh()`` first to see
        newly committed ones). Returns the number of episodes added."""
        added = 0
        wanted = None if tasks is None else set(tasks)
        keys = [k for k in self._keys() if k in set(reader.keys)]
        for meta in reader.episodes(success=True):
            if meta.episode_id in self._pos or not self.allowed(meta):
                continue
            if wanted is not None and meta.task not in wanted:
                continue
            self.add_episode(meta, reader.load_episode(meta.episode_id, keys=keys))
            added += 1
        return added

    def size(self, task: str) -> int:
        """Number of indexed windows of ``task`` (0 if none)."""
        ti = self.tasks.get(task)
        return 0 if ti is None else ti.index.ntotal

    def _neighbor(self, eid: str, step: int, raw: float, gain: float, own: bool = False) -> Neighbor:
        if self.metric == "l2":
            d = float(np.sqrt(max(raw, 0.0)))
            return Neighbor(eid, int(step), -d, d, float(gain), own)
        return Neighbor(eid, int(step), float(raw), 1.0 - float(raw), float(gain), own)

    def search(self, task: str, queries: np.ndarray, k: int) -> list[list[Neighbor]]:
        """Top-``k`` successful windows of ``task`` for each query.

        Args:
            task: task name; only windows of this task are searched.
            queries: (N, E) float32 embeddings (L2-normalised for the cosine key).
            k: neighbours per query (fewer when the task has fewer windows).

        Returns:
            N lists of :class:`Neighbor`, best first (empty lists when the task has no windows).
        """
        queries = np.ascontiguousarray(np.asarray(queries, np.float32).reshape(len(queries), -1))
        ti = self.tasks.get(task)
        if ti is None or ti.index.ntotal == 0 or len(queries) == 0:
            return [[] for _ in range(len(queries))]
        if queries.shape[1] != ti.index.d:
            raise ValueError(f"queries: expected dim {ti.index.d}, given {queries.shape[1]}")
        raw, labels = ti.index.search(queries, min(k, ti.index.ntotal))
        return [[self._neighbor(self.episode_ids[ti.episode[j]], ti.step[j], r, ti.gain[j])
                 for r, j in zip(rrow, lrow) if j >= 0] for rrow, lrow in zip(raw, labels)]

    def own_retries(self, failed_episode_id: str, query: np.ndarray) -> list[Neighbor]:
        """The nearest window of each indexed successful retry of ``failed_episode_id`` to ``query`` (E,),
        flagged ``own_retry``; best first."""
        out = []
        q = np.asarray(query, np.float32).reshape(-1)
        for eid in self.retries_of.get(failed_episode_id, []):
            steps, z, gains = self.windows_of[eid]
            raw = ((z - q) ** 2).sum(1) if self.metric == "l2" else z @ q
            j = int(np.argmin(raw) if self.metric == "l2" else np.argmax(raw))
            out.append(self._neighbor(eid, steps[j], float(raw[j]), gains[j], own=True))
        return sorted(out, key=lambda n: -n.similarity)


