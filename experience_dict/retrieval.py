"""FERT data: failure contexts, context embeddings, a faiss index of successful windows, FERT batches.

After "Learning from Fleet Experience" (failure-guided experience retrieval fine-tuning): every failed
episode gives a failure context (the window before its failure onset, :mod:`experience_dict.failure`); the
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

Priority (the choice, documented): per-task *learnability* ``p (1 - p)`` with ``p`` the task's success rate
over its most recent episodes (Beta(1, 1)-smoothed), plus a small floor. It is largest for tasks the policy
solves about half the time, small for tasks it already solves and for tasks it never solves (where the
retrieved supervision has least chance to help), after the learnability curricula of Tzannetos et al.,
"Proximal Curriculum for RL Agents" (TMLR 2023) and Foster & Foerster, "Learning to Reason at the Frontier of
Learnability" (2025). UCB over individual failure contexts was not chosen: a context is never re-tried, so
it has no reward of its own to estimate; a task's success rate is observed with every episode. Within a
task, contexts from newer policy versions weigh more (``2 ** -(v_max - v)``): those are the failures the
current policy still makes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

logging.getLogger("faiss.loader").setLevel(logging.WARNING)   # its CPU-feature probes log ModuleNotFoundError at INFO
import faiss
import numpy as np
import torch

from experience_dict.failure import DEFAULT_SIGNALS, annotate_failures
from experience_dict.fert_config import FertConfig

STATE_KEYS = ("observation.state", "observation.environment_state")
Encoder = Callable[[dict[str, np.ndarray]], np.ndarray]


# ----------------------------------------------------------------------------------------- embedding
class ContextEmbedder:
    """Embeds observation windows for cosine-similarity search.

    A window is the ``frames`` observations at steps ``anchor - (frames - 1) * stride .. anchor`` (edge-padded
    at the episode start). Without an ``encoder``, each key is normalised with the store statistics
    (``(x - mean) / max(std, std_floor)``, per dimension), each key's block is divided by ``sqrt(D_key)`` so
    every feature group counts equally whatever its width, the window is pooled and the result L2-normalised.
    With an ``encoder`` (e.g. the policy's observation encoder features), the raw windows go to the encoder
    and only its output is L2-normalised.

    Args:
        stats: ``reader.stats(keys)`` output: ``{key: {"mean": [D], "std": [D], ...}}``; frozen here, so
            embeddings stay comparable as the store grows. Unused with an ``encoder``.
        keys: observation keys to embed (default: ``observation.state`` + ``observation.environment_state``).
        frames: frames per window (the context length W in steps when ``stride == 1``), >= 1.
        stride: steps between frames, >= 1.
        pool: ``"flatten"`` (frames x D), ``"mean"`` (D) or ``"last"`` (D).
        encoder: optional ``f({key: (N, frames, ...) raw array}) -> (N, E)`` float array.
        std_floor: lower bound on std (feature units), avoids blowing up near-constant dimensions.

    Raises:
        KeyError: a key has no stats (when no encoder is given).
        ValueError: bad ``frames``, ``stride`` or ``pool``.
    """

    def __init__(self, stats: Mapping[str, Mapping[str, Sequence[float]]] | None,
                 keys: Sequence[str] = STATE_KEYS, frames: int = 8, stride: int = 1,
                 pool: str = "flatten", encoder: Encoder | None = None, std_floor: float = 1e-3):
        if frames < 1 or stride < 1:
            raise ValueError(f"frames and stride: expected >= 1, given frames={frames}, stride={stride}")
        if pool not in ("flatten", "mean", "last"):
            raise ValueError(f"pool: expected 'flatten', 'mean' or 'last', given {pool!r}")
        self.keys, self.frames, self.stride, self.pool, self.encoder = tuple(keys), frames, stride, pool, encoder
        self.offsets = -np.arange(frames - 1, -1, -1, dtype=np.int64) * stride      # (F,) ascending, ends at 0
        self._norm = {}
        if encoder is None:
            stats = stats or {}
            for k in self.keys:
                if k not in stats:
                    raise KeyError(f"ContextEmbedder: no stats for key {k!r} (given keys {sorted(stats)})")
                mean = np.asarray(stats[k]["mean"], np.float32)
                std = np.maximum(np.asarray(stats[k]["std"], np.float32), std_floor)
                self._norm[k] = (mean, std * np.sqrt(mean.size, dtype=np.float32))

    def windows(self, data: Mapping[str, np.ndarray], anchors: np.ndarray) -> dict[str, np.ndarray]:
        """Gather windows from one episode's arrays.

        Args:
            data: ``{key: (T, ...) array}`` of one episode (``reader.load_episode``).
            anchors: (N,) int steps in ``[0, T)``; each window ends at its anchor.

        Returns:
            ``{key: (N, frames, ...) array}``; steps before 0 repeat step 0.

        Raises:
            KeyError: a key is missing from ``data``. ValueError: an anchor is out of the episode.
        """
        missing = [k for k in self.keys if k not in data]
        if missing:
            raise KeyError(f"ContextEmbedder.windows: episode data lacks keys {missing}")
        T = len(data[self.keys[0]])
        anchors = np.asarray(anchors, dtype=np.int64)
        if anchors.size and (anchors.min() < 0 or anchors.max() >= T):
            raise ValueError(f"anchors: expected steps in [0, {T}), given [{anchors.min()}, {anchors.max()}]")
        idx = np.clip(anchors[:, None] + self.offsets[None, :], 0, T - 1)     # (N, F)
        return {k: np.asarray(data[k])[idx] for k in self.keys}

    def embed(self, windows: Mapping[str, np.ndarray]) -> np.ndarray:
        """(N, E) float32 L2-normalised embeddings of ``{key: (N, frames, ...)}`` windows."""
        if self.encoder is not None:
            z = np.asarray(self.encoder(dict(windows)), dtype=np.float32)
            if z.ndim != 2:
                raise ValueError(f"encoder output: expected (N, E), given shape {z.shape}")
        else:
            parts = []
            for k in self.keys:
                mean, scale = self._norm[k]
                x = (np.asarray(windows[k], np.float32) - mean) / scale                # (N, F, D)
                x = {"flatten": lambda a: a.reshape(len(a), -1), "mean": lambda a: a.mean(1),
                     "last": lambda a: a[:, -1]}[self.pool](x)
                parts.append(x)
            z = np.concatenate(parts, axis=1).astype(np.float32)
        return np.ascontiguousarray(z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12))

    def embed_episode(self, data: Mapping[str, np.ndarray], anchors: np.ndarray,
                      chunk: int = 1024) -> np.ndarray:
        """(N, E) embeddings of the windows ending at ``anchors`` of one episode, in chunks of ``chunk``."""
        anchors = np.asarray(anchors, dtype=np.int64)
        out = [self.embed(self.windows(data, anchors[i:i + chunk])) for i in range(0, len(anchors), chunk)]
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


class RelativeEmbedder:
    """Task-relative failure-cause key: where the hand, the object and the goal are relative to each other,
    and how they move, in metres; searched by L2 distance.

    Absolute coordinates under cosine similarity put the neighbours of a failing reach a median 6.0 cm from
    its goal (the success radius is 5 cm): the key could not see why the policy failed. This key is built from
    the quantities a failure is about, the way Behavior Retrieval (Du et al., 2023) and STRAP (Memmel et al.,
    2025) retrieve sub-trajectories by what the robot and the objects do. Per window ending at step ``t``
    (``frames`` steps, edge-padded at the episode start), with hand ``h`` (``observation.state[:3]``), gripper
    opening ``g`` (``observation.state[3]``, 0..1), object ``o`` (``observation.environment_state[0:3]``) and
    goal ``p`` (``observation.environment_state[14:17]``), all in metres (Meta-World layout,
    ``sim.metaworld_env``)::

        [h_t - o_t, h_t - p_t, o_t - p_t, h_t - h_{t-F+1}, o_t - o_{t-F+1}, g_t * gripper_scale]   (16,)

    The two displacement terms are the hand's and the object's motion over the window (velocity x window).
    The distance between two keys is in metres (the gripper term contributes at most ``gripper_scale``).
    ``extra`` (optional) appends a further per-window embedding of the ``history_actions`` actions before the
    anchor, e.g. the policy's pooled AED action-history embedding (:func:`aed_history_encoder`), which carries
    how the unit responds to commands; ``extra_scale`` puts it in metres-comparable units.

    Args:
        frames: window length in steps (>= 2 for the motion terms; 1 gives zero motion). stride: steps between
            frames (>= 1). gripper_scale: metres per unit of gripper opening in the key (>= 0).
        extra: optional ``f({"action": (N, H, A), "action_is_pad": (N, H)}) -> (N, E)``; extra_scale: its
            factor; history_actions: H.

    Raises:
        ValueError: bad ``frames``/``stride``.
    """

    metric = "l2"
    keys = STATE_KEYS

    def __init__(self, frames: int = 8, stride: int = 1, gripper_scale: float = 0.05,
                 extra: Encoder | None = None, extra_scale: float = 1.0, history_actions: int = 0):
        if frames < 1 or stride < 1 or history_actions < 0:
            raise ValueError(f"frames and stride: expected >= 1 and history_actions >= 0, given frames={frames}, "
                             f"stride={stride}, history_actions={history_actions}")
        self.frames, self.stride, self.gripper_scale = int(frames), int(stride), float(gripper_scale)
        self.extra, self.extra_scale = extra, float(extra_scale)
        self.history_actions = int(history_actions) if extra is not None else 0
        self.keys = tuple(STATE_KEYS) + (("action",) if self.history_actions else ())
        self.offsets = -np.arange(frames - 1, -1, -1, dtype=np.int64) * stride

    def windows(self, data: Mapping[str, np.ndarray], anchors: np.ndarray) -> dict[str, np.ndarray]:
        """State windows as :meth:`ContextEmbedder.windows`; with an action-history encoder also ``action``
        (N, H, A): the H actions before each anchor, and ``action_is_pad`` (N, H) for steps before the start."""
        missing = [k for k in self.keys if k not in data]
        if missing:
            raise KeyError(f"RelativeEmbedder.windows: episode data lacks keys {missing}")
        T = len(data[STATE_KEYS[0]])
        anchors = np.asarray(anchors, dtype=np.int64)
        if anchors.size and (anchors.min() < 0 or anchors.max() >= T):
            raise ValueError(f"anchors: expected steps in [0, {T}), given [{anchors.min()}, {anchors.max()}]")
        idx = np.clip(anchors[:, None] + self.offsets[None, :], 0, T - 1)
        out = {k: np.asarray(data[k])[idx] for k in STATE_KEYS}
        if self.history_actions:
            h = anchors[:, None] + np.arange(-self.history_actions, 0)[None, :]          # (N, H)
            out["action"] = np.asarray(data["action"])[np.clip(h, 0, T - 1)]
            out["action_is_pad"] = h < 0
        return out

    embed_episode = ContextEmbedder.embed_episode

    def embed(self, windows: Mapping[str, np.ndarray]) -> np.ndarray:
        """(N, 16 [+ E]) float32 keys of ``{key: (N, frames, D)}`` windows (metres; see the class docstring)."""
        st = np.asarray(windows["observation.state"], np.float32)               # (N, F, 4)
        env = np.asarray(windows["observation.environment_state"], np.float32)  # (N, F, 17)
        if st.shape[-1] < 4 or env.shape[-1] < 17:
            raise ValueError(f"RelativeEmbedder: expected state (.., 4) and environment_state (.., 17), given "
                             f"{st.shape} and {env.shape}")
        h, g = st[..., :3], st[..., 3]
        o, p = env[..., 0:3], env[..., 14:17]
        parts = [h[:, -1] - o[:, -1], h[:, -1] - p[:, -1], o[:, -1] - p[:, -1], h[:, -1] - h[:, 0],
                 o[:, -1] - o[:, 0], g[:, -1:] * self.gripper_scale]
        if self.extra is not None:
            parts.append(np.asarray(self.extra(dict(windows)), np.float32) * self.extra_scale)
        return np.ascontiguousarray(np.concatenate(parts, axis=1).astype(np.float32))


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
    (:func:`experience_dict.failure.segment_gain` over ``gate_horizon`` steps) and anchors in the last
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
        signals: progress signals for the score (:data:`experience_dict.failure.DEFAULT_SIGNALS`).
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
        from experience_dict.failure import progress_score, segment_gain

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


# ----------------------------------------------------------------------------------------- priority
class TaskPriority:
    """Per-task priority from recent success statistics (see the module docstring for the choice).

    ``p_task = (successes + 1) / (episodes + 2)`` over the last ``window`` episodes of the task
    (Beta(1, 1) posterior mean); priority ``p (1 - p) + floor`` for ``method="learnability"``, ``1`` for
    ``method="uniform"``.

    Args:
        method: ``"learnability"`` or ``"uniform"``.
        window: recent episodes per task kept (>= 1).
        floor: added to every task's learnability so no task is starved (>= 0).
        exclude_units: units whose episodes :meth:`observe` ignores (held-out units).
    """

    def __init__(self, method: str = "learnability", window: int = 50, floor: float = 0.02,
                 exclude_units: Iterable[int] = ()):
        if method not in ("learnability", "uniform"):
            raise ValueError(f"priority method: expected 'learnability' or 'uniform', given {method!r}")
        if window < 1 or floor < 0:
            raise ValueError(f"window >= 1 and floor >= 0 expected, given window={window}, floor={floor}")
        self.method, self.window, self.floor = method, window, floor
        self.exclude_units = {int(u) for u in exclude_units}
        self.recent: dict[str, deque] = {}
        self.seen: set[str] = set()

    def update(self, task: str, success: bool) -> None:
        """Record one episode outcome of ``task``."""
        self.recent.setdefault(task, deque(maxlen=self.window)).append(bool(success))

    def observe(self, reader) -> int:
        """Update from the store's non-demo episodes not seen yet (oldest first); returns how many."""
        new = [m for m in reader.episodes(is_demo=False)
               if m.episode_id not in self.seen and int(m.unit_id) not in self.exclude_units]
        new.sort(key=commit_order)
        for m in new:
            self.seen.add(m.episode_id)
            self.update(m.task, m.success)
        return len(new)

    def success_rate(self, task: str) -> float:
        """Smoothed recent success rate of ``task`` (0.5 with no data)."""
        r = self.recent.get(task, ())
        return (sum(r) + 1.0) / (len(r) + 2.0)

    def priority(self, task: str) -> float:
        """Unnormalised priority of ``task``."""
        if self.method == "uniform":
            return 1.0
        p = self.success_rate(task)
        return p * (1.0 - p) + self.floor

    def probs(self, tasks: Sequence[str]) -> np.ndarray:
        """(len(tasks),) float64 sampling probabilities over ``tasks`` (sum 1)."""
        w = np.array([self.priority(t) for t in tasks], dtype=np.float64)
        return w / w.sum() if len(w) else w

    def state_dict(self) -> dict:
        """JSON-able state (for the learner's checkpoint)."""
        return {"recent": {t: list(map(bool, d)) for t, d in self.recent.items()}, "seen": sorted(self.seen)}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` output."""
        self.recent = {t: deque(v, maxlen=self.window) for t, v in state["recent"].items()}
        self.seen = set(state["seen"])


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
             neighbours: str = "fleet") -> Retrieval:
    """Top-k successful windows of the same task for every failure context, with sampling weights.

    Candidates per context: the nearest window of each of its own successful retries first (same task, unit
    and reset seed, re-attempted with exploration; ``own_retries_first``), then the nearest windows of the
    task's index over the whole fleet. With ``neighbours="own_retries"`` only the own successful retries are
    candidates: a failure is supervised by the exploration that recovered it, and a failure that no retry
    recovered retrieves nothing (its share goes to the replay), so no far-away fleet success supervises it.
    With ``gate`` (``{"min_gain", "beta", "max_weight"}``,
    :func:`experience_dict.failure.progress_advantage`), a candidate whose segment does not make more progress
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

    Raises:
        ValueError: ``len(queries) != len(contexts)`` or bad ``top_k``/``temperature``/gate/``confidence_scale``/
            ``neighbours`` values.
    """
    from experience_dict.failure import progress_advantage

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
    oversample = 4 if gate is not None else 1
    for task, idx in by_task.items():
        for i, nb in zip(idx, index.search(task, queries[idx], top_k * oversample)):
            own_only = neighbours == "own_retries"
            own = index.own_retries(contexts[i].episode_id, queries[i]) if (own_retries_first or own_only) else []
            seen = {(n.episode_id, n.step) for n in own}
            cand = own + ([] if own_only else [n for n in nb if (n.episode_id, n.step) not in seen])
            cand = [n for n in cand if min_similarity is None or n.similarity >= min_similarity]
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


# ----------------------------------------------------------------------------------------- batches
class FertDataset(torch.utils.data.Dataset):
    """Training windows of one FERT round: retrieved successful windows mixed with demonstration replay.

    One epoch of the dataset is a fixed plan of ``n_retrieved + n_replay`` slots, so a plain shuffled
    ``DataLoader`` (what ``policies.aed_diffusion.training.train_policy`` uses) already sees the stated mix:

    * retrieved slots ``0 .. n_retrieved - 1``: with ``weighting="loss"`` every retrieved entry once, with
      ``sample_weight = entry weight x n_retrieved`` (mean 1; the policy's diffusion loss is a
      ``sample_weight``-weighted mean); with ``weighting="sample"`` ``n_retrieved`` entries drawn with
      probability proportional to their weight (with replacement), ``sample_weight = 1``.
      Either way the expected loss is the similarity- and priority-weighted loss over retrieved windows. When
      the entry weights sum to ``m < 1`` (context confidence), every retrieved ``sample_weight`` is scaled by
      ``m``: the retrieved windows weigh less than the replay windows in the loss.
    * replay slots ``n_retrieved ..``: ``n_replay = round(n_retrieved * r / (1 - r))`` windows (``r`` =
      ``replay_ratio``) drawn uniformly from every step of the replay episodes (without replacement while
      possible), ``sample_weight = 1``. So replay is exactly ``n_replay / len(self)`` ~= ``r`` of an epoch.
      With ``r = 1`` or no retrieved entry, the dataset is replay only (every replay window once).
    * ``segment_steps = S > 1`` (``fert.segment_steps``): a retrieved entry stands for the *segment* of its
      successful episode that follows the matched anchor, the windows anchored at ``step, step + 1, ..,
      step + S - 1`` (cut at the episode's end), each carrying ``1 / len(segment)`` of the entry's weight. The
      design brief's "the retrieved segments' actions become supervision": the policy learns what the
      successful robot did from the matched state onwards, not only its next action chunk. ``S = 1``: the
      matched window only.
    * ``replay_all=True`` (the learner's default, ``fert.replay_all``): the retrieved slots are tiled
      ``k`` times (same per-slot weights) with ``k`` the smallest making ``n_replay`` cover every replay window,
      so an epoch replays all the demonstrations once and the mix is still ``r``.

    Windows come from ``experience_dict.sampler.WindowDataset`` with the policy's ``windows`` spec (no second
    windowing code): an item is a WindowDataset item (``{name: tensor (len(offsets), ...), name_is_pad,
    "episode_index", "step", "task", "unit_id"}``; ``episode_index`` indexes the source or the replay
    WindowDataset, see ``"fert.is_replay"``) plus ``"sample_weight"`` (float32 scalar tensor),
    ``"fert.is_replay"`` (bool scalar tensor) and ``"fert.similarity"`` (float32 scalar tensor, cosine
    similarity of the retrieved window to its failure context; 1.0 for replay).

    Args:
        reader: store reader.
        retrieval: this round's :class:`Retrieval`.
        replay_episodes: EpisodeMeta of the episodes to replay (the demonstrations).
        windows: the policy's window spec, ``policy.window_spec()``.
        replay_ratio: fraction ``r`` of replay slots, in [0, 1].
        weighting: ``"loss"`` or ``"sample"`` (above).
        seed: seed of the slot plan.
        replay_all: tile the retrieved slots so an epoch replays every demonstration window (above).
        segment_steps: steps of successful continuation per retrieved entry (>= 1, above).

    Raises:
        ValueError: bad ratio / weighting, or neither retrieved entries nor replay episodes.
    """

    def __init__(self, reader, retrieval: Retrieval, replay_episodes: Sequence, windows: Mapping,
                 replay_ratio: float = 0.5, weighting: str = "loss", seed: int = 0, replay_all: bool = False,
                 segment_steps: int = 1):
        from experience_dict.sampler import WindowDataset
        if int(segment_steps) < 1:
            raise ValueError(f"segment_steps: expected >= 1, given {segment_steps}")
        if not 0.0 <= replay_ratio <= 1.0:
            raise ValueError(f"replay_ratio: expected a fraction in [0, 1], given {replay_ratio}")
        if weighting not in ("loss", "sample"):
            raise ValueError(f"weighting: expected 'loss' or 'sample', given {weighting!r}")
        self.retrieval, self.replay_ratio, self.weighting = retrieval, replay_ratio, weighting
        rng = np.random.default_rng(seed)
        replay_episodes = list(replay_episodes)
        self.replay = WindowDataset(reader, replay_episodes, windows=dict(windows)) if replay_episodes else None
        n_rep_windows = 0 if self.replay is None else len(self.replay)
        use_ret = len(retrieval) > 0 and replay_ratio < 1.0
        if not use_ret and n_rep_windows == 0:
            raise ValueError("FertDataset: no retrieved windows and no replay episodes")
        # retrieved part: slot -> entry, and its loss weight
        if use_ret:
            src = [reader.episode(e) for e in sorted(set(retrieval.episode_id))]
            self.source = WindowDataset(reader, src, windows=dict(windows))
            # WindowDataset anchors every step of its episodes in order: item = first item of episode + step
            first = dict(zip((e.episode_id for e in src), np.cumsum([0] + [e.length for e in src[:-1]])))
            length = {e.episode_id: int(e.length) for e in src}
            w = retrieval.weight / retrieval.weight.sum()
            # expand each entry into its segment: (source window index, entry, probability) per segment window
            idx, ent, p = [], [], []
            for j, (e, s) in enumerate(zip(retrieval.episode_id, retrieval.step)):
                m = max(1, min(int(segment_steps), length[e] - int(s)))
                idx.extend(range(first[e] + int(s), first[e] + int(s) + m))
                ent.extend([j] * m)
                p.extend([w[j] / m] * m)
            self._ret_index, self._seg_entry = np.array(idx, np.int64), np.array(ent, np.int64)
            p = np.asarray(p, np.float64)
            n = len(p)
            # entry weights summing to less than 1 (context confidence, ``retrieve(confidence_scale=...)``): the
            # retrieved windows' loss weights shrink by that mass, relative to the replay windows' weight 1
            mass = float(retrieval.weight.sum())
            mass = 1.0 if mass > 1.0 - 1e-9 else max(mass, 0.0)
            if weighting == "loss":
                self._ret_entry, self._ret_w = np.arange(n), (p * n * mass).astype(np.float32)
            else:
                self._ret_entry = rng.choice(n, n, p=p / p.sum())
                self._ret_w = np.full(n, mass, np.float32)
        else:
            self.source, self._ret_index, self._seg_entry = None, np.zeros(0, np.int64), np.zeros(0, np.int64)
            self._ret_entry, self._ret_w = np.zeros(0, np.int64), np.zeros(0, np.float32)
        if replay_all and len(self._ret_entry) and n_rep_windows and 0.0 < replay_ratio < 1.0:
            # tile the retrieved slots so that one epoch replays every demonstration window once at the stated
            # ratio (few failure contexts would otherwise leave only a handful of replay windows per round)
            need = int(np.ceil(n_rep_windows * (1.0 - replay_ratio) / replay_ratio))
            k = max(1, -(-need // len(self._ret_entry)))
            self._ret_entry, self._ret_w = np.tile(self._ret_entry, k), np.tile(self._ret_w, k)
        self.n_retrieved = len(self._ret_entry)
        # replay part
        if n_rep_windows == 0:
            self.n_replay = 0
        elif self.n_retrieved == 0:
            self.n_replay = n_rep_windows
        else:
            self.n_replay = round(self.n_retrieved * replay_ratio / (1.0 - replay_ratio))
        reps = -(-self.n_replay // n_rep_windows) if n_rep_windows else 0
        self._rep_index = (np.concatenate([rng.permutation(n_rep_windows) for _ in range(reps)])[:self.n_replay]
                           if reps else np.zeros(0, np.int64))

    def __len__(self) -> int:
        return self.n_retrieved + self.n_replay

    def fetch(self, indices: Sequence[int]) -> dict:
        """A collated batch of slots (what collating ``[self[i] for i in indices]`` gives, read with one vectorised
        ``WindowDataset.fetch`` per part; retrieved slots first, then replay slots).

        Raises:
            IndexError: a slot outside ``[0, len(self))``.
        """
        idx = np.asarray(indices, np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"FertDataset index out of range [0, {len(self)}): {list(indices)}")
        ret, rep = idx[idx < self.n_retrieved], idx[idx >= self.n_retrieved] - self.n_retrieved
        pieces = []
        if len(ret):
            e = self._ret_entry[ret]
            b = self.source.fetch(self._ret_index[e].tolist())
            b["sample_weight"] = torch.as_tensor(self._ret_w[ret], dtype=torch.float32)
            b["fert.is_replay"] = torch.zeros(len(ret), dtype=torch.bool)
            b["fert.similarity"] = torch.as_tensor(self.retrieval.similarity[self._seg_entry[e]], dtype=torch.float32)
            pieces.append(b)
        if len(rep):
            b = self.replay.fetch(self._rep_index[rep].tolist())
            b["sample_weight"] = torch.ones(len(rep))
            b["fert.is_replay"] = torch.ones(len(rep), dtype=torch.bool)
            b["fert.similarity"] = torch.ones(len(rep))
            pieces.append(b)
        return {k: (torch.cat([p[k] for p in pieces]) if torch.is_tensor(pieces[0][k])
                    else [x for p in pieces for x in p[k]]) for k in pieces[0]}

    def __getitem__(self, i: int) -> dict:
        if not isinstance(i, (int, np.integer)):
            return self.fetch(i)
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"FertDataset index {i} out of range [0, {len(self)})")
        if i < self.n_retrieved:
            e = int(self._ret_entry[i])
            item = self.source[int(self._ret_index[e])]
            item["sample_weight"] = torch.tensor(float(self._ret_w[i]))
            item["fert.is_replay"] = torch.tensor(False)
            item["fert.similarity"] = torch.tensor(float(self.retrieval.similarity[self._seg_entry[e]]))
            return item
        item = self.replay[int(self._rep_index[i - self.n_retrieved])]
        item["sample_weight"] = torch.tensor(1.0)
        item["fert.is_replay"] = torch.tensor(True)
        item["fert.similarity"] = torch.tensor(1.0)
        return item


class FertBatchSampler(torch.utils.data.Sampler):
    """Batches of :class:`FertDataset` slots with the replay mix exact in *every* batch (for a learner that
    runs its own loop; a shuffled DataLoader gets the mix per epoch).

    Every batch holds ``round(batch_size * replay_ratio)`` replay slots and the rest retrieved slots, each
    drawn uniformly with replacement within its part (the slots already carry the weighting). When a part
    is empty the other fills the batch. Batch ``b`` comes from ``numpy.random.default_rng([seed, b])``, so a
    resumed learner continues exactly from ``start`` (its data cursor).

    Args:
        dataset: the round's :class:`FertDataset` (its ``replay_ratio`` is used).
        batch_size: slots per batch (>= 1).
        num_batches: the sampler yields batches ``start .. num_batches - 1``.
        seed: integer seed.
        start: first batch index (resume cursor).

    Raises:
        ValueError: bad sizes.
    """

    def __init__(self, dataset: FertDataset, batch_size: int, num_batches: int, seed: int = 0, start: int = 0):
        if batch_size < 1 or num_batches < 0 or start < 0:
            raise ValueError(f"expected batch_size >= 1, num_batches >= 0, start >= 0; given {batch_size}, "
                             f"{num_batches}, {start}")
        self.ds, self.batch_size, self.num_batches, self.seed, self.start = dataset, batch_size, num_batches, seed, start

    def n_replay(self) -> int:
        """Replay slots per batch."""
        if self.ds.n_replay == 0:
            return 0
        if self.ds.n_retrieved == 0:
            return self.batch_size
        return round(self.batch_size * self.ds.replay_ratio)

    def batch(self, b: int) -> list[int]:
        """Slot indices of batch ``b`` (deterministic in ``(seed, b)``): retrieved first, then replay."""
        rng = np.random.default_rng([self.seed, b])
        nr = self.n_replay()
        ret = rng.integers(0, self.ds.n_retrieved, self.batch_size - nr) if nr < self.batch_size else []
        rep = self.ds.n_retrieved + rng.integers(0, self.ds.n_replay, nr) if nr else []
        return [int(i) for i in ret] + [int(i) for i in rep]

    def __iter__(self):
        for b in range(self.start, self.num_batches):
            yield self.batch(b)

    def __len__(self) -> int:
        return max(self.num_batches - self.start, 0)


def aed_history_encoder(policy, scale_m: float = 0.05) -> tuple[Encoder, float, int]:
    """The AED action-history part of the retrieval key, from an AED diffusion policy (duck-typed:
    ``policy.tokenize_history``, ``policy.aed``, ``policy.config.aed``; experience_dict does not import policies).

    The H actions before an anchor are tokenized by the policy's action tokenizer and embedded by its Action
    Experience Dictionary to one vector per group ((N, G, D), layer-normalised); the valid groups are averaged
    to (N, D). Returns ``(encoder, extra_scale, H)`` for :class:`RelativeEmbedder`, with ``extra_scale =
    scale_m / sqrt(D)`` so two unrelated histories (distance ~ sqrt(2 D) after the layer norm) sit ~1.4 x
    ``scale_m`` metres apart in the key.

    Raises:
        ValueError: the policy has no AED.
    """
    cfg = getattr(getattr(policy, "config", None), "aed", None)
    if cfg is None or not cfg.enabled or getattr(policy, "aed", None) is None:
        raise ValueError("aed_history_encoder: the policy has no Action Experience Dictionary (aed.enabled=false)")
    H = int(cfg.history_actions)

    @torch.no_grad()
    def encode(windows: dict[str, np.ndarray]) -> np.ndarray:
        b = policy.tokenize_history({"history.action": np.asarray(windows["action"], np.float32),
                                     "history.action_is_pad": np.asarray(windows["action_is_pad"], bool)})
        dev = policy.device
        g = policy.aed(b["history.tokens"].to(dev), b["history.token_mask"].bool().to(dev),
                       b["history.group_mask"].bool().to(dev))                   # (N, G, D)
        m = b["history.group_mask"].bool().to(dev).float()[..., None]
        z = (g * m).sum(1) / m.sum(1).clamp(min=1.0)
        return z.float().cpu().numpy()

    dim = int(getattr(policy.config, "dim", 128))
    return encode, float(scale_m) / float(np.sqrt(dim)), H


def policy_encoder(policy, pool: str = "mean") -> Encoder:
    """An ``encoder`` for :class:`ContextEmbedder` from an AED diffusion policy's observation encoder.

    Feeds the raw windows (``{key: (N, F, ...)}``, the policy's ``config.input_shapes`` keys) through the
    policy's own normalisation and ``obs_encoder`` -> ``(N, F, K, dim)`` tokens, averaged over the K tokens of
    a frame and pooled over frames (``"mean"``) or flattened (``"flatten"``) -> ``(N, E)`` float32, no grad.
    Duck-typed (``policy.obs_encoder``, ``policy._frames``, ``policy.device``): experience_dict does not
    import policies.
    """
    if pool not in ("mean", "flatten"):
        raise ValueError(f"pool: expected 'mean' or 'flatten', given {pool!r}")

    @torch.no_grad()
    def encode(windows: dict[str, np.ndarray]) -> np.ndarray:
        batch = {k: torch.as_tensor(np.asarray(v)).to(policy.device) for k, v in windows.items()}
        tok = policy.obs_encoder(policy._frames(batch)).mean(dim=-2)           # (N, F, dim)
        z = tok.mean(dim=1) if pool == "mean" else tok.flatten(1)
        return z.float().cpu().numpy()

    return encode


# ----------------------------------------------------------------------------------------- one object
class FertData:
    """Everything the learner needs per FERT round, configured by ``cfg.fert``
    (:class:`experience_dict.fert_config.FertConfig`).

    Per round::

        fert = FertData(reader, cfg.fert, stats=reader.stats(list(STATE_KEYS), episodes=demos),
                        exclude_units=heldout_units)          # once; keep it across rounds
        fert.update()                     # reader.refresh(), failure onsets, index new successes, task stats
        retrieval = fert.retrieve()       # failure contexts (training units) -> top-k successful windows
        dataset = fert.dataset(retrieval, demos, policy.window_spec(), seed=round_idx)
        train_policy(..., policy=policy, dataset=dataset)     # or DataLoader(dataset, batch_sampler=
                                                              #   FertBatchSampler(dataset, B, n, seed))
        write_retrieval_audit(retrieval, fert.index, out_dir, round_idx)      # experience_dict.audit

    Args:
        reader: ``ExperienceStore`` reader.
        cfg: a :class:`~experience_dict.fert_config.FertConfig` or a mapping of its keys (a missing key takes its
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
        sig = fc.onset.signals
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
        return retrieve(self.index, queries, contexts, self.priority, top_k=fc.top_k, temperature=fc.temperature,
                        min_similarity=fc.min_similarity, gate=self.gate, own_retries_first=fc.own_retries_first,
                        confidence_scale=fc.confidence_scale_m, neighbours=fc.neighbours)

    def _with_gain(self, c: FailureContext) -> FailureContext:
        """``c`` with ``gain``: the failed episode's progress over the gate horizon after its onset."""
        import dataclasses

        from experience_dict.failure import progress_score, segment_gain

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
