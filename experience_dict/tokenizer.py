"""FAST-style action tokenizer and action-history alignment.

The tokenizer follows FAST (Pertsch et al., 2025, "FAST: Efficient Action Tokenization for
Vision-Language-Action Models", code: physical-intelligence/fast): a per-dimension discrete cosine
transform (DCT-II, orthonormal, ``scipy.fft.dct(norm="ortho")``) of an action chunk, scaled and rounded to
integers, then byte-pair encoding (HF ``tokenizers`` BPE) over the integer coefficient stream, flattened
frequency-major (low frequencies of every dimension first) as FAST does.

Here the chunk is one *action group*: the ``r`` actions of one frame interval of the AED history window
(docs/AED.md). A group is put into its *aligned* form before tokenizing:
relative dimensions (end-effector deltas) become the running sum since the group's first frame, so the
group's last row holds the interval's summed displacement; absolute dimensions (gripper) keep their commands,
so the last row holds the group's last command. The last row of an aligned group is therefore exactly the
frame-interval action of docs/AED.md (relative summed, absolute last), and the earlier rows keep the path
within the interval for the DCT to compress.

Everything here is numpy on the CPU (the policy's preprocessor runs it in the data path at train time and
in ``select_action`` at deployment time). Saved as JSON only.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.fft import dct, idct
from tokenizers import Tokenizer, models, trainers

log = logging.getLogger(__name__)

FORMAT = "fleetmind.fast_action_tokenizer/v1"
# Integer coefficient v maps to code point _CHAR_BASE + v - min_coeff (CJK ideographs, no whitespace/control
# chars), skipping the UTF-16 surrogates U+D800..U+DFFF, which are not characters (HF tokenizers cannot encode
# them): an alphabet of more than 35,328 symbols continues at U+E000.
_CHAR_BASE = 0x4E00
_SURROGATES = (0xD800, 0xE000)


def _code_points(offsets: np.ndarray) -> np.ndarray:
    """Alphabet offsets (ints >= 0) -> code points (int64), skipping the surrogate block."""
    c = np.asarray(offsets, dtype=np.int64) + _CHAR_BASE
    return np.where(c >= _SURROGATES[0], c + (_SURROGATES[1] - _SURROGATES[0]), c)


def _offsets(code_points: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_code_points`."""
    c = np.asarray(code_points, dtype=np.int64)
    return np.where(c >= _SURROGATES[1], c - (_SURROGATES[1] - _SURROGATES[0]), c) - _CHAR_BASE


MEMO_SIZE = 1 << 16  # memoised group encodings per tokenizer (~15 MB at most)


def align_groups(actions: np.ndarray, is_pad: np.ndarray | None, r: int,
                 relative_dims: Sequence[int], absolute_dims: Sequence[int]):
    """Group an action history by frame interval and put each group in aligned form.

    Args:
        actions: (..., H, D) float actions, oldest first (the last ``H`` actions before the anchor step).
            ``H`` must be a multiple of ``r``.
        is_pad: (..., H) bool, True where the step lies outside the episode (the sampler's ``_is_pad``;
            at the episode start the sampler repeats the first action there). None: nothing padded.
        r: actions per group (per frame interval).
        relative_dims: dimensions that are deltas (Meta-World: dx, dy, dz -> [0, 1, 2]); they are summed.
        absolute_dims: dimensions that are commands (gripper -> [3]); the group keeps the last one.

    Returns:
        aligned: (..., G, r, D) float32, G = H // r. Relative dims: running sum within the group (padded
            steps contribute zero motion); absolute dims: the command of each step (padded steps keep the
            sampler's edge value).
        group_action: (..., G, D) float32, the frame-interval action = ``aligned[..., -1, :]``
            (relative dims summed over the group, absolute dims the group's last command).
        group_mask: (..., G) bool, True where the group holds at least one real (non-padded) action.

    Raises:
        ValueError: if shapes disagree, ``H`` is not a multiple of ``r`` or a dim index is out of range.
    """
    actions = np.asarray(actions, dtype=np.float32)
    if actions.ndim < 2:
        raise ValueError(f"actions: expected (..., H, D), given shape {actions.shape}")
    *lead, H, D = actions.shape
    if r < 1 or H % r != 0:
        raise ValueError(f"history length H={H} must be a positive multiple of r={r}")
    rel, ab = list(relative_dims), list(absolute_dims)
    if sorted(rel + ab) != list(range(D)):
        raise ValueError(f"relative_dims {rel} + absolute_dims {ab} must partition range({D})")
    if is_pad is None:
        is_pad = np.zeros((*lead, H), dtype=bool)
    is_pad = np.asarray(is_pad, dtype=bool)
    if is_pad.shape != (*lead, H):
        raise ValueError(f"is_pad: expected shape {(*lead, H)}, given {is_pad.shape}")
    G = H // r
    a = actions.copy()
    if rel:
        a[..., rel] = np.where(is_pad[..., None], 0.0, a[..., rel])
    a = a.reshape(*lead, G, r, D)
    if rel:
        a[..., rel] = np.cumsum(a[..., rel], axis=-2)
    group_mask = ~is_pad.reshape(*lead, G, r).all(-1)
    return a, a[..., -1, :].copy(), group_mask


def episode_windows(episode_actions: Sequence[np.ndarray], r: int, relative_dims: Sequence[int],
                    absolute_dims: Sequence[int], action_dim: int, stride: int = 1) -> np.ndarray:
    """Every window of ``r`` consecutive actions (step ``stride``) of every episode, aligned (``align_groups``):
    ``(N, r, D)`` float32 (``N = 0`` when no episode has ``r`` actions).

    Args:
        episode_actions: list of (T_i, D) raw actions.
    """
    windows = []
    for a in episode_actions:
        a = np.asarray(a, dtype=np.float32)
        if len(a) >= r:
            idx = np.arange(0, len(a) - r + 1, stride)[:, None] + np.arange(r)[None]
            windows.append(align_groups(a[idx], None, r, relative_dims, absolute_dims)[0][:, 0])
    return np.concatenate(windows) if windows else np.zeros((0, r, action_dim), np.float32)


@dataclass
class FitReport:
    """What ``ActionTokenizer.fit`` measured on its training groups (raw action units)."""

    n_groups: int
    alphabet_size: int
    vocab_size: int
    mean_tokens_per_group: float
    max_tokens_per_group: int
    roundtrip_max_abs_error: float
    roundtrip_mean_abs_error: float
    tolerance: list[float]


class ActionTokenizer:
    """FAST-style tokenizer of aligned action groups (``r`` actions x ``D`` dims) to BPE token ids.

    Use ``ActionTokenizer.fit`` to train one on a store's actions, ``save``/``load`` for JSON files.
    Token ids lie in ``[0, vocab_size)``; ``pad_id == vocab_size`` pads ``encode_history`` outputs.
    """

    def __init__(self, *, r: int, action_dim: int, relative_dims: Sequence[int], absolute_dims: Sequence[int],
                 scale: float, low: Sequence[float], high: Sequence[float], min_coeff: int, max_coeff: int,
                 bpe: Tokenizer, fit_report: dict | None = None):
        self.r, self.action_dim = int(r), int(action_dim)
        self.relative_dims, self.absolute_dims = [int(i) for i in relative_dims], [int(i) for i in absolute_dims]
        self.scale = float(scale)
        self.low = np.asarray(low, dtype=np.float64)
        self.high = np.asarray(high, dtype=np.float64)
        if self.low.shape != (self.action_dim,) or self.high.shape != (self.action_dim,):
            raise ValueError(f"low/high: expected shape ({self.action_dim},), given {self.low.shape}/{self.high.shape}")
        self.min_coeff, self.max_coeff = int(min_coeff), int(max_coeff)
        self.bpe = bpe
        self.fit_report = fit_report
        self.vocab_size = bpe.get_vocab_size()
        self.pad_id = self.vocab_size
        self.max_tokens_per_group = self.r * self.action_dim  # BPE never emits more tokens than characters
        self._id_to_str = [bpe.id_to_token(i) for i in range(self.vocab_size)]
        self._memo: dict[str, list[int]] = {}  # coefficient string -> BPE ids (training revisits the same groups)

    def __getstate__(self) -> dict:  # pickled into DataLoader workers: leave the memo behind
        return {**self.__dict__, "_memo": {}}

    # ---------------------------------------------------------------- numeric part (DCT + quantization)
    @property
    def _half_range(self) -> np.ndarray:
        return np.maximum((self.high - self.low) / 2.0, 1e-6)

    @property
    def tolerance(self) -> np.ndarray:
        """(D,) bound on |decode(encode(x)) - x| per dimension, raw units, for x within [low, high].

        Rounding leaves each DCT coefficient within 0.5/scale; the orthonormal inverse DCT-II of length r has
        basis values of at most 1/sqrt(r) (k=0) and sqrt(2/r) (k>0), so each value is within
        0.5/scale * (1/sqrt(r) + (r-1)*sqrt(2/r)) in normalized units, times the dimension's half range.
        """
        r = self.r
        bound = 0.5 / self.scale * (1.0 / math.sqrt(r) + (r - 1) * math.sqrt(2.0 / r))
        return bound * self._half_range

    def _check_groups(self, groups: np.ndarray) -> np.ndarray:
        groups = np.asarray(groups, dtype=np.float64)
        if groups.ndim < 2 or groups.shape[-2:] != (self.r, self.action_dim):
            raise ValueError(f"action groups: expected (..., {self.r}, {self.action_dim}), given {groups.shape}")
        return groups

    def coefficients(self, groups: np.ndarray) -> np.ndarray:
        """Quantized DCT coefficients of aligned groups.

        Args:
            groups: (N, r, D) aligned action groups (see ``align_groups``), raw units.
        Returns:
            (N, r*D) int64, frequency-major (all dims' k=0 first), clipped to [min_coeff, max_coeff].
        """
        g = self._check_groups(groups)
        x = np.clip((g - self.low) / self._half_range - 1.0, -1.0, 1.0)  # per-dim min/max -> [-1, 1]
        c = np.rint(dct(x, axis=-2, norm="ortho") * self.scale).astype(np.int64)
        return np.clip(c.reshape(*c.shape[:-2], -1), self.min_coeff, self.max_coeff)

    def outside_range(self, groups: np.ndarray) -> np.ndarray:
        """Which aligned groups hold a value outside the fitted ``[low, high]`` (``coefficients`` clips those:
        their round trip is no longer within ``tolerance``).

        Args:
            groups: (N, r, D) aligned action groups, raw units.
        Returns:
            (N, D) bool: group n leaves the range in dimension d (by more than 1e-6 of the half range).
        """
        g = self._check_groups(groups)
        x = (g - self.low) / self._half_range - 1.0
        return (np.abs(x) > 1.0 + 1e-6).any(axis=-2)

    def range_report(self, episode_actions: Sequence[np.ndarray]) -> dict:
        """How much of some episodes' actions the tokenizer's fitted range covers: every window of ``r``
        consecutive actions of every episode, aligned as in :meth:`fit`.

        Args:
            episode_actions: list of (T_i, D) raw actions.
        Returns:
            ``{"groups": N, "outside": groups with any dimension outside, "share": outside / N (0 when N = 0),
            "outside_per_dim": [D counts], "low": [D], "high": [D], "seen_low": [D], "seen_high": [D]}``.
        """
        g = episode_windows(episode_actions, self.r, self.relative_dims, self.absolute_dims, self.action_dim)
        out = self.outside_range(g) if len(g) else np.zeros((0, self.action_dim), bool)
        flat = g.reshape(-1, self.action_dim)
        return {"groups": int(len(g)), "outside": int(out.any(1).sum()),
                "share": float(out.any(1).mean()) if len(g) else 0.0,
                "outside_per_dim": out.sum(0).astype(int).tolist(),
                "low": self.low.tolist(), "high": self.high.tolist(),
                "seen_low": flat.min(0).tolist() if len(flat) else None,
                "seen_high": flat.max(0).tolist() if len(flat) else None}

    def groups_from_coefficients(self, coeffs: np.ndarray) -> np.ndarray:
        """Inverse of ``coefficients``: (N, r*D) ints -> (N, r, D) float32 aligned groups, raw units."""
        c = np.asarray(coeffs, dtype=np.float64).reshape(-1, self.r, self.action_dim) / self.scale
        x = idct(c, axis=-2, norm="ortho")
        return ((x + 1.0) * self._half_range + self.low).astype(np.float32)

    def _to_string(self, coeffs: np.ndarray) -> list[str]:
        """(N, r*D) ints -> N strings of r*D code points (numpy's UTF-32 view, no per-character Python)."""
        c = np.ascontiguousarray(_code_points(coeffs - self.min_coeff), dtype="<u4")
        return c.view(f"<U{c.shape[-1]}").reshape(-1).tolist()

    # ---------------------------------------------------------------- token part (BPE)
    def encode(self, groups: np.ndarray) -> list[list[int]]:
        """Aligned groups (N, r, D) (or one (r, D)) -> N lists of BPE token ids (variable length <= r*D).

        Encodings are memoised per coefficient string (bounded at ``MEMO_SIZE`` entries): BPE is
        deterministic, and training windows share most groups.
        """
        g = self._check_groups(groups).reshape(-1, self.r, self.action_dim)
        strings = self._to_string(self.coefficients(g))
        memo = self._memo
        new = list({t for t in strings if t not in memo})
        if new:
            if len(memo) + len(new) > MEMO_SIZE:
                # full: start afresh, and then every string of this call is new (clearing only made room for
                # ``new`` once dropped the entries this call still looks up: a KeyError on mw10, experiment 31)
                memo.clear()
                new = list(set(strings))
            memo.update(zip(new, (e.ids for e in self.bpe.encode_batch(new))))
        return [list(memo[t]) for t in strings]

    def decode(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Token id lists -> (N, r, D) float32 aligned groups, raw units.

        Raises:
            ValueError: on an id outside [0, vocab_size) or a token stream that does not decode to r*D
                coefficients (not produced by ``encode``).
        """
        out = np.zeros((len(ids), self.r * self.action_dim), dtype=np.int64)
        n_ids = len(self._id_to_str)
        for n, seq in enumerate(ids):
            # checked, not caught: Python's indexing would wrap a negative id to a valid token silently
            if any(not 0 <= int(i) < n_ids for i in seq if int(i) != self.pad_id):
                raise ValueError(f"token id outside [0, {self.vocab_size}) in sequence {n}: {list(seq)}")
            text = "".join(self._id_to_str[int(i)] for i in seq if int(i) != self.pad_id)
            vals = _offsets(np.fromiter((ord(ch) for ch in text), dtype=np.int64)) + self.min_coeff
            if vals.size != out.shape[1]:
                raise ValueError(f"sequence {n} decodes to {vals.size} coefficients, expected {out.shape[1]}")
            out[n] = vals
        return self.groups_from_coefficients(out)

    def encode_history(self, actions: np.ndarray, is_pad: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Tokenize action histories for the AED (the policy's preprocessor).

        Args:
            actions: (B, H, D) float raw actions, oldest first; H a multiple of ``r``.
            is_pad: (B, H) bool or None (see ``align_groups``).
        Returns:
            dict with ``tokens`` (B, G, L) int64 padded with ``pad_id``, ``token_mask`` (B, G, L) bool
            (True = real token), ``group_mask`` (B, G) bool (True = group holds a real action);
            G = H // r, L = r * D (fixed, so shapes are static).
        """
        actions = np.asarray(actions, dtype=np.float32)
        if actions.ndim != 3 or actions.shape[-1] != self.action_dim:
            raise ValueError(f"action history: expected (B, H, {self.action_dim}), given {actions.shape}")
        B, H, _ = actions.shape
        aligned, _, group_mask = align_groups(actions, is_pad, self.r, self.relative_dims, self.absolute_dims)
        G, L = H // self.r, self.max_tokens_per_group
        ids = self.encode(aligned.reshape(B * G, self.r, self.action_dim))
        lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.full((B * G, L), self.pad_id, dtype=np.int64)
        tokens[np.arange(L) < lens[:, None]] = np.fromiter((i for seq in ids for i in seq), dtype=np.int64,
                                                             count=int(lens.sum()))
        tokens = tokens.reshape(B, G, L)
        return {"tokens": tokens, "token_mask": tokens != self.pad_id, "group_mask": group_mask}

    # ---------------------------------------------------------------- fitting and files
    @classmethod
    def fit(cls, episode_actions: Sequence[np.ndarray], *, r: int, relative_dims: Sequence[int],
            absolute_dims: Sequence[int], scale: float = 10.0, vocab_size: int = 1024, min_frequency: int = 2,
            stride: int = 1) -> ActionTokenizer:
        """Train a tokenizer on episodes' actions.

        Every window of ``r`` consecutive actions (step ``stride``) of every episode becomes an aligned group;
        per-dimension min/max of the aligned groups set the normalization to [-1, 1]; BPE (HF ``tokenizers``)
        is trained on the coefficient strings with the full coefficient alphabet. The round-trip error on
        the training groups and the mean tokens per group are logged and kept in ``fit_report``.

        Args:
            episode_actions: list of (T_i, D) float arrays (raw actions of one episode each).
            r: actions per group. scale: DCT coefficient scale before rounding (FAST default 10).
            vocab_size: BPE vocabulary size, alphabet included (training may stop earlier when no pair
                occurs ``min_frequency`` times).
        Raises:
            ValueError: no episode with at least ``r`` steps, inconsistent D, or an alphabet larger than
                ``vocab_size``.
        """
        dims = {np.asarray(a).shape[-1] for a in episode_actions}
        if len(dims) != 1:
            raise ValueError(f"episodes disagree on action dim: {sorted(dims)}")
        D = dims.pop()
        groups = episode_windows(episode_actions, r, relative_dims, absolute_dims, D, stride)  # (N, r, D)
        if not len(groups):
            raise ValueError(f"no episode has at least r={r} actions")
        low = groups.reshape(-1, D).min(0).astype(np.float64)
        high = groups.reshape(-1, D).max(0).astype(np.float64)
        # Provisional tokenizer (empty BPE) to compute the coefficient range with the real normalization.
        tmp = cls(r=r, action_dim=D, relative_dims=relative_dims, absolute_dims=absolute_dims, scale=scale,
                  low=low, high=high, min_coeff=-(2 ** 31), max_coeff=2 ** 31, bpe=Tokenizer(models.BPE()))
        coeffs = tmp.coefficients(groups)
        cmin, cmax = int(coeffs.min()), int(coeffs.max())
        alphabet = [chr(c) for c in _code_points(np.arange(cmax - cmin + 1)).tolist()]
        if len(alphabet) > vocab_size:
            raise ValueError(f"coefficient alphabet ({len(alphabet)} symbols for scale={scale}) exceeds "
                             f"vocab_size={vocab_size}; lower scale or raise vocab_size")
        bpe = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                      special_tokens=[], initial_alphabet=alphabet,
                                      limit_alphabet=len(alphabet), max_token_length=r * D)
        points = _code_points(coeffs - cmin).tolist()
        bpe.train_from_iterator(("".join(map(chr, row)) for row in points), trainer=trainer)
        tok = cls(r=r, action_dim=D, relative_dims=relative_dims, absolute_dims=absolute_dims, scale=scale,
                  low=low, high=high, min_coeff=cmin, max_coeff=cmax, bpe=bpe)
        ids = tok.encode(groups)
        tok._memo.clear()  # the fit's own groups: not worth keeping
        err = np.abs(tok.decode(ids) - groups)
        lens = np.array([len(s) for s in ids])
        tok.fit_report = FitReport(
            n_groups=len(groups), alphabet_size=len(alphabet), vocab_size=tok.vocab_size,
            mean_tokens_per_group=float(lens.mean()), max_tokens_per_group=int(lens.max()),
            roundtrip_max_abs_error=float(err.max()), roundtrip_mean_abs_error=float(err.mean()),
            tolerance=tok.tolerance.tolist()).__dict__
        log.info("action tokenizer fit: %s", tok.fit_report)
        return tok

    def to_dict(self) -> dict:
        """JSON-able dict (parameters, fit report and the BPE model as HF ``tokenizers`` JSON)."""
        return {"format": FORMAT, "r": self.r, "action_dim": self.action_dim,
                "relative_dims": self.relative_dims, "absolute_dims": self.absolute_dims, "scale": self.scale,
                "low": self.low.tolist(), "high": self.high.tolist(), "min_coeff": self.min_coeff,
                "max_coeff": self.max_coeff, "fit_report": self.fit_report, "bpe": json.loads(self.bpe.to_str())}

    @classmethod
    def from_dict(cls, d: dict) -> ActionTokenizer:
        """Inverse of ``to_dict``. Raises ValueError on another format or a missing field."""
        if d.get("format") != FORMAT:
            raise ValueError(f"action tokenizer: expected format {FORMAT!r}, given {d.get('format')!r}")
        try:
            return cls(r=d["r"], action_dim=d["action_dim"], relative_dims=d["relative_dims"],
                       absolute_dims=d["absolute_dims"], scale=d["scale"], low=d["low"], high=d["high"],
                       min_coeff=d["min_coeff"], max_coeff=d["max_coeff"],
                       bpe=Tokenizer.from_str(json.dumps(d["bpe"])), fit_report=d.get("fit_report"))
        except KeyError as e:
            raise ValueError(f"action tokenizer JSON lacks field {e}") from e

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as one JSON file."""
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> ActionTokenizer:
        """Read a tokenizer written by ``save``."""
        return cls.from_dict(json.loads(Path(path).read_text()))
