"""FERT batches: a round's retrieved windows mixed with demonstration replay, as training windows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fleet.fert.retrieve import Retrieval


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


