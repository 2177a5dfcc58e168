"""Training windows from the experience store, as a torch ``Dataset``.

Each item is anchored at one step ``t`` of one episode; every named window reads a feature key at offsets
relative to ``t`` (LeRobot's ``delta_indices``). Offsets outside the episode repeat the edge frame and are
flagged in ``<name>_is_pad``, as Diffusion Policy's ``SequenceSampler`` pads (Chi et al. 2023, replay buffer
+ sequence sampler) and LeRobot's ``LeRobotDataset`` masks.

Reading: small per-step features (state, action, reward, progress) are read once per shard and kept in
memory; images are read one Zarr chunk at a time and kept in a per-process LRU cache of decoded chunks
(``cache_bytes``). Nothing is opened until the first item, so each DataLoader worker opens its own handles.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from experience_dict.store import EpisodeMeta, ExperienceStore


class WindowDataset(Dataset):
    """Windows of observations / actions around every step of the given episodes.

    Args:
        store: an :class:`ExperienceStore` (its snapshot; call ``refresh`` and build a new dataset to grow).
        episodes: the episodes to sample (default: every episode of the snapshot).
        windows: ``{output name: (feature key, offsets)}``, e.g.
            ``{"observation.state": ("observation.state", [-1, 0]), "action": ("action", list(range(16))),
            "history.action": ("action", list(range(-8, 0)))}``.
        cache_bytes: budget of the per-process LRU cache of decoded image chunks (bytes; 0 disables it).

    Item (``ds[i]``): for each window name a tensor ``(len(offsets), *feature shape)`` with the store's dtype
    (images stay uint8 HWC), ``<name>_is_pad``: ``(len(offsets),)`` bool; plus ``"episode_index"`` (index into
    :attr:`episodes`), ``"step"`` (anchor step t), ``"task"`` (str) and ``"unit_id"`` (int).

    Fastest loading: ``DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), B, drop_last=True),
    batch_size=None, num_workers=2)`` (each worker builds whole batches with :meth:`fetch`); a plain
    ``DataLoader(ds, batch_size=B, shuffle=True)`` also works (``__getitems__`` + ``default_collate``).

    Raises:
        KeyError: a window names a key the store lacks. ValueError: empty offsets or no episodes.
    """

    def __init__(self, store: ExperienceStore, episodes: Sequence[EpisodeMeta] | None = None,
                 windows: dict[str, tuple[str, Sequence[int]]] | None = None, cache_bytes: int = 1 << 30):
        self.store = store
        self.episodes = list(store.episodes() if episodes is None else episodes)
        if not self.episodes:
            raise ValueError("WindowDataset needs at least one episode")
        if not windows:
            raise ValueError("WindowDataset needs at least one window {name: (key, offsets)}")
        self.windows: dict[str, tuple[str, np.ndarray]] = {}
        for name, (key, offsets) in windows.items():
            if key not in store.features:
                raise KeyError(f"window {name!r} reads key {key!r}, which the store lacks; keys: {store.keys}")
            offs = np.asarray(list(offsets), dtype=np.int64)
            if offs.ndim != 1 or offs.size == 0:
                raise ValueError(f"window {name!r}: offsets must be a non-empty list of ints, given {offsets!r}")
            self.windows[name] = (key, offs)
        self.image_keys = {k for k, _ in self.windows.values() if len(store.features[k]["shape"]) == 3}
        lengths = np.array([e.length for e in self.episodes], dtype=np.int64)
        self.cum = np.concatenate([[0], np.cumsum(lengths)])
        self.starts = np.array([e.start for e in self.episodes], dtype=np.int64)
        self.lengths = lengths
        self.shard_end: dict[str, int] = {}
        for e in self.episodes:
            self.shard_end[e.shard] = max(self.shard_end.get(e.shard, 0), e.start + e.length)
        self.shard_order = sorted(self.shard_end)
        sid = {s: j for j, s in enumerate(self.shard_order)}
        self.ep_shard_id = np.array([sid[e.shard] for e in self.episodes], dtype=np.int64)
        # row of each episode in the in-memory concatenation of small features over shards
        shard_off = np.concatenate([[0], np.cumsum([self.shard_end[s] for s in self.shard_order])])
        self.gstarts = shard_off[self.ep_shard_id] + self.starts
        self._chunk_rows: dict[tuple[str, str], int] = {}
        self.cache_bytes = int(cache_bytes)
        self._reset_caches()

    def _reset_caches(self) -> None:
        self._pid = os.getpid()
        self._small: dict[str, np.ndarray] = {}
        self._chunks: OrderedDict[tuple[str, str, int], np.ndarray] = OrderedDict()
        self._chunk_bytes = 0
        self._checked: set[tuple[int, str]] = set()   # (episode index, key) checked against its record
        self.cache_hits = self.cache_misses = 0

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in ("_small", "_chunks", "_checked"):
            state[k] = type(state[k])()
        state["_chunk_bytes"] = 0
        return state

    def __len__(self) -> int:
        return int(self.cum[-1])

    # -- reading ------------------------------------------------------------------------------------
    def _small_array(self, key: str) -> np.ndarray:
        """All rows of ``key`` the dataset can touch, every shard concatenated (rows ``gstarts``-based)."""
        a = self._small.get(key)
        if a is None:
            parts = []
            for j, shard in enumerate(self.shard_order):
                # only the chunks this dataset's episodes touch are read (a corrupt chunk elsewhere in the shard,
                # e.g. of an episode left out by store.on_corrupt=skip, is never decoded); a corrupt one raises
                # CorruptChunkError naming store, shard, array, chunk and episodes
                end, cr = self.shard_end[shard], self.chunk_rows(shard, key)
                mine = self.ep_shard_id == j
                need = np.unique(np.concatenate([np.arange(a // cr, (a + n - 1) // cr + 1) for a, n in
                                                 zip(self.starts[mine], self.lengths[mine])]))
                if len(need) == -(-end // cr):
                    parts.append(self.store.read(shard, key, 0, end))
                    continue
                f = self.store.features[key]
                buf = np.zeros((end, *f["shape"]), dtype=f["dtype"])
                for c in need:
                    buf[c * cr:min((c + 1) * cr, end)] = self.store.read(shard, key, c * cr, min((c + 1) * cr, end))
                parts.append(buf)
            a = np.concatenate(parts)
            # every episode's rows against the statistics its commit record holds (a chunk file holding valid
            # bytes of another place passes its checksum; its rows do not match): CorruptChunkError naming it
            for e, g in zip(self.episodes, self.gstarts):
                self.store.check_rows(e, key, a[g:g + e.length])
            self._small[key] = a
        return a

    def _chunk(self, shard: str, key: str, c: int) -> np.ndarray:
        ck = (shard, key, c)
        chunk = self._chunks.get(ck)
        if chunk is not None:
            self.cache_hits += 1
            self._chunks.move_to_end(ck)
            return chunk
        self.cache_misses += 1
        cr = self.chunk_rows(shard, key)
        lo, hi = c * cr, min((c + 1) * cr, self.shard_end[shard])
        chunk = self.store.read(shard, key, lo, hi)
        self._check_episodes(shard, key, lo, hi)
        if self.cache_bytes > 0:
            self._chunks[ck] = chunk
            self._chunk_bytes += chunk.nbytes
            while self._chunk_bytes > self.cache_bytes and self._chunks:
                _, old = self._chunks.popitem(last=False)
                self._chunk_bytes -= old.nbytes
        return chunk

    def _check_episodes(self, shard: str, key: str, lo: int, hi: int) -> None:
        """On a chunk's first decode in this process: every episode of the dataset with rows in ``lo .. hi-1``
        not checked yet is read whole and checked against its commit record's statistics
        (``ExperienceStore.check_rows``), once per (episode, key) per process."""
        sid = self.shard_order.index(shard)
        hit = np.flatnonzero((self.ep_shard_id == sid) & (self.starts < hi) & (self.starts + self.lengths > lo))
        for i in hit:
            if (int(i), key) in self._checked:
                continue
            e = self.episodes[int(i)]
            self.store.check_rows(e, key, self.store.read(shard, key, e.start, e.start + e.length))
            self._checked.add((int(i), key))

    def _image_rows(self, key: str, ep: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (B, K) (shard-local) of image ``key`` for episodes ``ep`` (B,): (B, K, H, W, C)."""
        out = np.empty((*rows.shape, *self.store.features[key]["shape"]), dtype=self.store.features[key]["dtype"])
        shard_ids = self.ep_shard_id[ep][:, None].repeat(rows.shape[1], 1)
        for sid in np.unique(shard_ids):
            shard = self.shard_order[sid]
            cr = self.chunk_rows(shard, key)
            in_shard = shard_ids == sid
            chunk_ids = np.where(in_shard, rows // cr, -1)
            for c in np.unique(chunk_ids[in_shard]):
                sel = chunk_ids == c
                out[sel] = self._chunk(shard, key, int(c))[rows[sel] - c * cr]
        return out

    def chunk_rows(self, shard: str, key: str) -> int:
        """Rows per Zarr chunk of ``key`` in ``shard``."""
        k = (shard, key)
        if k not in self._chunk_rows:
            self._chunk_rows[k] = self.store.array(shard, key).chunks[0]
        return self._chunk_rows[k]

    def fetch(self, indices: Sequence[int]) -> dict:
        """A collated batch of windows: what ``default_collate([ds[i] for i in indices])`` gives, built vectorised.

        Returns:
            ``{name: (B, K, *shape), name_is_pad: (B, K) bool, "episode_index": (B,) int64, "step": (B,) int64,
            "task": list[str], "unit_id": (B,) int64}``.

        Raises:
            IndexError: an index outside ``[0, len(self))``.
        """
        if os.getpid() != self._pid:  # forked into a worker after the parent read something
            self._reset_caches()
        i = np.asarray(indices, dtype=np.int64).reshape(-1)
        if i.size and (i.min() < 0 or i.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)}): {list(indices)}")
        e = np.searchsorted(self.cum, i, side="right") - 1
        t = i - self.cum[e]
        length = self.lengths[e][:, None]
        batch: dict = {}
        for name, (key, offs) in self.windows.items():
            pos = t[:, None] + offs[None, :]  # (B, K)
            local = np.minimum(np.maximum(pos, 0), length - 1)
            if key in self.image_keys:
                vals = self._image_rows(key, e, self.starts[e][:, None] + local)
            else:
                vals = self._small_array(key)[self.gstarts[e][:, None] + local]
            batch[name] = torch.from_numpy(vals)
            batch[f"{name}_is_pad"] = torch.from_numpy((pos < 0) | (pos >= length))
        batch["episode_index"] = torch.from_numpy(e)
        batch["step"] = torch.from_numpy(t)
        batch["task"] = [self.episodes[j].task for j in e]
        batch["unit_id"] = torch.tensor([self.episodes[j].unit_id for j in e], dtype=torch.int64)
        return batch

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        """Per-window items of a batch (torch's DataLoader calls this, then ``default_collate``)."""
        batch = self.fetch(indices)
        tensors = [n for n in batch if n not in ("episode_index", "step", "task", "unit_id")]
        return [{**{n: batch[n][b] for n in tensors}, "episode_index": int(batch["episode_index"][b]),
                 "step": int(batch["step"][b]), "task": batch["task"][b], "unit_id": int(batch["unit_id"][b])}
                for b in range(len(batch["task"]))]

    def __getitem__(self, i):
        """``ds[i]`` (int): one window (see the class docstring); ``ds[[i, j, ...]]``: a collated batch
        (:meth:`fetch`), for ``DataLoader(ds, sampler=BatchSampler(...), batch_size=None)``, which skips
        per-item collation."""
        if isinstance(i, (int, np.integer)):
            return self.__getitems__([i])[0]
        return self.fetch(i)


class MixtureDataset(Dataset):
    """A fixed mix of several window datasets: one epoch is ``size`` slots, ``round(size * share)`` of them from
    each part (the shares renormalised over the non-empty parts), each part's slots tiling shuffled passes over its
    items. Uniform batches over the slots then see the stated mix (a FERT round: retrieved segments, critic
    targets and per-task replay).

    Args:
        parts: ``[(name, dataset, share)]``; a dataset is a ``WindowDataset``, a ``FertDataset``, a
            ``policies.distill.ChunkTargets`` or any dataset of window dicts; ``share`` >= 0.
        keys: the item keys kept (the policy's window names and their ``_is_pad`` flags); every item also gets
            ``sample_weight`` (1.0 unless the part gives one), so batches from different parts collate together.
        size: slots per epoch (>= 1). seed: seed of the slot plan.

    ``ds[[i, j, ...]]`` / :meth:`fetch`: a collated batch (a part's own ``fetch`` when it has one). :attr:`slots`:
    ``{name: slots}``.

    Raises:
        ValueError: no part with a positive share and at least one item, a negative share, or ``size < 1``.
    """

    def __init__(self, parts: Sequence[tuple[str, Dataset, float]], keys: Sequence[str], size: int, seed: int = 0):
        if int(size) < 1 or any(float(s) < 0 for _, _, s in parts):
            raise ValueError(f"MixtureDataset: expected size >= 1 and shares >= 0, given {size}, "
                             f"{[(n, s) for n, _, s in parts]}")
        live = [(n, d, float(s)) for n, d, s in parts if d is not None and len(d) > 0 and float(s) > 0]
        if not live:
            raise ValueError(f"MixtureDataset: no part with items and a positive share among {[n for n, _, _ in parts]}")
        total = sum(s for _, _, s in live)
        rng = np.random.default_rng(int(seed))
        self.parts = [d for _, d, _ in live]
        self.names = [n for n, _, _ in live]
        self.keys = set(keys) | {"sample_weight"}
        part_of, item_of = [], []
        for j, (_, d, s) in enumerate(live):
            n = max(1, round(int(size) * s / total))
            reps = -(-n // len(d))
            item_of.append(np.concatenate([rng.permutation(len(d)) for _ in range(reps)])[:n])
            part_of.append(np.full(n, j, np.int64))
        self.part_of, self.item_of = np.concatenate(part_of), np.concatenate(item_of)
        self.slots = {n: int((self.part_of == j).sum()) for j, n in enumerate(self.names)}

    def __len__(self) -> int:
        return len(self.part_of)

    def _clean(self, batch: dict, n: int) -> dict:
        out = {k: v for k, v in batch.items() if k in self.keys}
        if "sample_weight" not in out:
            out["sample_weight"] = torch.ones(n)
        out["sample_weight"] = out["sample_weight"].float().reshape(n)
        return out

    def fetch(self, indices: Sequence[int]) -> dict:
        """Collated batch of the slots ``indices`` (grouped by part; the order within the batch follows the parts)."""
        from torch.utils.data import default_collate

        idx = np.asarray(indices, np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"MixtureDataset index out of range [0, {len(self)})")
        pieces = []
        for j, d in enumerate(self.parts):
            items = self.item_of[idx[self.part_of[idx] == j]]
            if not len(items):
                continue
            if callable(getattr(d, "fetch", None)):
                b = d.fetch(items.tolist())
            else:
                b = default_collate([{k: v for k, v in d[int(i)].items() if k in self.keys} for i in items])
            pieces.append(self._clean(b, len(items)))
        common = set.intersection(*(set(p) for p in pieces))
        return {k: torch.cat([p[k] for p in pieces]) for k in sorted(common)}

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            return {k: v[0] for k, v in self.fetch([int(i)]).items()}
        return self.fetch(i)
