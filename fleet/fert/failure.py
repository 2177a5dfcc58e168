"""Failure analysis: where a failed episode's task progress stops improving for good.

FERT (after "Learning from Fleet Experience") turns every failed episode into a *failure context*: the
observation/action window just before the failure onset. The onset is read from the sim's progress signals
(``progress.<signal>`` arrays in the store, see docs/INTERFACES.md); when an episode carries no usable
signal the context falls back to the episode's last ``W`` steps.

Progress score (the choice, documented)
---------------------------------------
Meta-World v3's ``info`` signals do not mean the same thing in every task: ``near_object`` is a 0/1 flag in
push but a distance in reach, ``grasp_reward`` is a grasp score in push but the hand-goal distance in reach,
``obj_to_target`` is the constant 0 in hammer and assembly. Only three signals measure task progress in the
same direction across the suite, so the score averages those, each mapped to [0, 1]-ish "higher is better":

* ``progress.in_place_reward`` - Meta-World's tolerance reward of the object-to-goal distance, in [0, 1];
  used as is.
* ``progress.obj_to_target`` - the object-to-goal distance in metres; used as the fraction of the initial
  distance closed, ``1 - d_t / d_0`` (dropped when ``d_0`` is ~0, e.g. hammer/assembly where it is 0).
* ``progress.unscaled_reward`` - Meta-World v3's staged dense reward, in [0, 10] (10 = solved); divided
  by 10. It also rises for the reach and grasp stages, so a policy that reaches but never moves the object
  still shows (some) progress.

A signal that is missing, non-finite or constant over the episode carries no information and is dropped; the
score is the mean of the rest. No signal left means "no signal" and the fallback onset is used.

Onset
-----
With the score ``p`` (T,) and its running best ``b_t = max(p_0..p_t)``, the onset is the first step ``t``
after which the score never again rises more than ``tolerance`` above ``b_t``:

    onset = min { t : max(p_{t+1}, ..., p_{T-1}) <= b_t + tolerance }

(the last step of the episode always qualifies). The failure context is the ``W`` steps ending at the onset,
``[onset - W + 1, onset]``. The fallback onset is ``T - 1``, so the fallback context is the last ``W`` steps
(starting at step ``T - W``). The fallback is used when there is no usable signal, and also when the score
never rises more than ``tolerance`` above its first value: then the signals saw no progress at all (on real
Meta-World rollouts this happens e.g. in drawer-close, whose signals do not move while the hand approaches the
drawer) and an onset at step 0 would only point at the initial state, while the last W steps show where the
policy got stuck.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

import numpy as np

# key -> (kind, scale). kind "level": value / scale, higher is better.
# kind "distance": 1 - value / value[0], lower distance is better.
DEFAULT_SIGNALS: dict[str, tuple[str, float]] = {
    "progress.in_place_reward": ("level", 1.0),
    "progress.obj_to_target": ("distance", 1.0),
    "progress.unscaled_reward": ("level", 10.0),
}
_KINDS = ("level", "distance")


def _check_signals(signals: Mapping[str, tuple[str, float]]) -> None:
    for key, spec in signals.items():
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and spec[0] in _KINDS):
            raise ValueError(f"progress signal {key!r}: expected (kind, scale) with kind in {_KINDS}, "
                             f"given {spec!r}")
        if not float(spec[1]) > 0:
            raise ValueError(f"progress signal {key!r}: scale must be > 0, given {spec[1]!r}")


def progress_score(progress: Mapping[str, np.ndarray],
                   signals: Mapping[str, tuple[str, float]] = DEFAULT_SIGNALS,
                   eps: float = 1e-6) -> np.ndarray | None:
    """Combined task-progress score of one episode (see the module docstring for the choice of signals).

    Args:
        progress: ``{"progress.<signal>": (T,) array}``; other keys are ignored.
        signals: ``{key: (kind, scale)}``; kind ``"level"`` maps ``x -> x / scale``, kind ``"distance"``
            maps ``d -> 1 - d / d_0`` (``scale`` unused; the signal is dropped when ``|d_0| <= eps``).
        eps: a signal whose peak-to-peak range is ``<= eps`` is treated as constant (no information).

    Returns:
        (T,) float64 score, higher = more progress, or ``None`` when no usable signal is present.

    Raises:
        ValueError: a signal spec is malformed, or the used signals have different lengths / are not 1-D.
    """
    _check_signals(signals)
    parts, length = [], None
    for key, (kind, scale) in signals.items():
        if key not in progress:
            continue
        x = np.asarray(progress[key], dtype=np.float64)
        if x.ndim != 1:
            raise ValueError(f"progress signal {key!r}: expected shape (T,), given {x.shape}")
        if length is not None and len(x) != length:
            raise ValueError(f"progress signal {key!r}: expected length {length}, given {len(x)}")
        length = len(x)
        if len(x) == 0 or not np.all(np.isfinite(x)) or np.ptp(x) <= eps:
            continue
        if kind == "level":
            parts.append(x / float(scale))
        elif abs(x[0]) > eps:
            parts.append(1.0 - x / x[0])
    if not parts:
        return None
    return np.mean(parts, axis=0)


def onset_from_score(score: np.ndarray, tolerance: float) -> int:
    """First step after which the score never rises more than ``tolerance`` above its running best.

    Args:
        score: (T,) progress score, T >= 1, finite.
        tolerance: improvement (in score units) still counted as "no improvement", >= 0.

    Returns:
        onset step in ``[0, T - 1]``.

    Raises:
        ValueError: empty or non-finite score, or negative tolerance.
    """
    p = np.asarray(score, dtype=np.float64)
    if p.ndim != 1 or len(p) == 0 or not np.all(np.isfinite(p)):
        raise ValueError(f"score: expected a non-empty finite (T,) array, given shape {p.shape}")
    if tolerance < 0:
        raise ValueError(f"tolerance: expected >= 0, given {tolerance}")
    best = np.maximum.accumulate(p)
    # suffix_max[t] = max(p[t+1:]), -inf after the last step
    suffix_max = np.concatenate([np.maximum.accumulate(p[::-1])[::-1][1:], [-np.inf]])
    return int(np.argmax(suffix_max <= best + tolerance))


def find_failure_onset(progress: Mapping[str, np.ndarray], length: int, window: int,
                       tolerance: float = 0.02,
                       signals: Mapping[str, tuple[str, float]] = DEFAULT_SIGNALS) -> tuple[int, str]:
    """Failure onset of one failed episode.

    Args:
        progress: ``{"progress.<signal>": (T,) array}`` as loaded from the store.
        length: episode length T in steps (>= 1).
        window: failure-context length W in steps (>= 1); only documents the fallback here.
        tolerance: see :func:`onset_from_score` (score units; the default 0.02 is 2% of the full
            in-place / distance / reward range).
        signals: see :func:`progress_score`.

    Returns:
        ``(onset, method)``: onset in ``[0, T - 1]``; method ``"progress"`` or ``"fallback"`` (no usable
        signal, or no rise above ``tolerance`` over the first step: onset ``T - 1``, so the context is the
        last W steps).

    Raises:
        ValueError: ``length < 1``, ``window < 1`` or signals of a length other than ``length``.
    """
    if length < 1:
        raise ValueError(f"length: expected >= 1, given {length}")
    if window < 1:
        raise ValueError(f"window: expected >= 1, given {window}")
    score = progress_score(progress, signals)
    if score is not None and len(score) != length:
        raise ValueError(f"progress signals: expected length {length}, given {len(score)}")
    if score is None or score.max() - score[0] <= tolerance:
        return length - 1, "fallback"
    return onset_from_score(score, tolerance), "progress"


def context_steps(onset: int, window: int) -> np.ndarray:
    """Steps of the failure context: the ``window`` steps ending at ``onset`` (inclusive).

    Returns (W,) int64 steps ``onset - W + 1 .. onset``; steps < 0 (before the episode) are kept and are
    edge-padded by the embedder / window sampler.
    """
    return np.arange(onset - window + 1, onset + 1, dtype=np.int64)


def annotate_failures(reader, window: int, tolerance: float = 0.02,
                      signals: Mapping[str, tuple[str, float]] = DEFAULT_SIGNALS,
                      overwrite: bool = False, **filters) -> dict[str, tuple[int, str]]:
    """Locate and store the failure onset of every failed episode that has none yet.

    For each ``reader.episodes(success=False, is_demo=False, **filters)`` whose ``failure_onset`` is None
    (or all of them with ``overwrite``), loads its ``progress.*`` arrays, computes
    :func:`find_failure_onset` and writes it with ``reader.set_failure_onset(ep_id, onset)``.

    Args:
        reader: an ``ExperienceStore`` reader (docs/INTERFACES.md); signals the store does not hold
            (``reader.keys``) are skipped.
        window, tolerance, signals: see :func:`find_failure_onset`.
        overwrite: recompute episodes that already have an onset.
        **filters: passed to ``reader.episodes`` (e.g. ``task=``, ``unit_id=``).

    Returns:
        ``{episode_id: (onset, method)}`` for the episodes annotated in this call.
    """
    done = () if overwrite else {m.episode_id for m in reader.episodes(success=False, is_demo=False, **filters)
                                 if m.failure_onset is not None}
    out = failure_onsets(reader, window, tolerance, signals, known=done, **filters)
    for eid, (onset, _) in out.items():
        reader.set_failure_onset(eid, onset)
    return out


def failure_onsets(reader, window: int, tolerance: float = 0.02,
                   signals: Mapping[str, tuple[str, float]] = DEFAULT_SIGNALS, known: Container[str] = (),
                   **filters) -> dict[str, tuple[int, str]]:
    """The failure onset of every failed, non-demo episode not in ``known``, computed with these ``signals``
    whatever the store holds (nothing is written).

    Learners with other onset settings share one store (an analysis arm beside the fleet's learner), so each keeps
    its own onsets in memory; the store's ``failure_onset`` (:func:`annotate_failures`) is the first one written.

    Args: see :func:`find_failure_onset` and :func:`annotate_failures`.

    Returns:
        ``{episode_id: (onset, method)}``.
    """
    out: dict[str, tuple[int, str]] = {}
    stored = set(reader.keys)
    available = [k for k in signals if k in stored]
    for meta in reader.episodes(success=False, is_demo=False, **filters):
        if meta.episode_id in known:
            continue
        progress = reader.load_episode(meta.episode_id, keys=available) if available else {}
        out[meta.episode_id] = find_failure_onset(progress, meta.length, window, tolerance, signals)
    return out


# ----------------------------------------------------------------------------------------- progress gate
def segment_gain(score: np.ndarray, starts: np.ndarray, horizon: int) -> np.ndarray:
    """Progress gained over a segment: ``score[min(s + horizon, T - 1)] - score[s]`` per start ``s``.

    Args:
        score: (T,) progress score (:func:`progress_score`). starts: (N,) int steps in ``[0, T)``.
        horizon: segment length in steps (>= 1).

    Returns:
        (N,) float64 gains (score units: fractions of the task's progress range).

    Raises:
        ValueError: ``horizon < 1`` or a start outside the episode.
    """
    p = np.asarray(score, np.float64)
    s = np.asarray(starts, np.int64)
    if int(horizon) < 1:
        raise ValueError(f"horizon: expected >= 1, given {horizon}")
    if s.size and (s.min() < 0 or s.max() >= len(p)):
        raise ValueError(f"starts: expected steps in [0, {len(p)}), given [{s.min()}, {s.max()}]")
    return p[np.minimum(s + int(horizon), len(p) - 1)] - p[s]


def progress_advantage(success_gain: np.ndarray, failure_gain: float, min_gain: float = 0.02,
                       beta: float = 0.05, max_weight: float = 20.0) -> tuple[np.ndarray, np.ndarray]:
    """Progress gate and advantage weights of retrieved segments against the failure they supervise.

    The advantage of a retrieved segment is how much more task progress it makes over ``horizon`` steps than
    the failed episode made over the same horizon after its failure onset:
    ``A = gain(segment) - gain(failure after onset)``. A segment passes the gate when it makes progress at all
    and more than the failure did: ``gain > max(failure_gain, 0) + min_gain``. A segment that gains nothing
    (one taken at the end of an episode teaches "stop here") never passes. Passing segments are weighted by
    ``min(exp(A / beta), max_weight)``: advantage-weighted regression (Peng et al., "Advantage-Weighted
    Regression", 2019, which clips the weights at 20), with the progress signals standing in for a learned
    value; self-imitation learning (Oh et al., 2018) likewise imitates only what did better than expected.

    Args:
        success_gain: (N,) gains of the candidate segments (:func:`segment_gain`).
        failure_gain: the failed episode's gain over the horizon after its onset.
        min_gain: margin in score units (>= 0). beta: temperature (> 0). max_weight: clip (> 0).

    Returns:
        ``(passed, weight)``: (N,) bool and (N,) float64 (0 where the gate refuses).

    Raises:
        ValueError: ``beta <= 0``, ``max_weight <= 0`` or ``min_gain < 0``.
    """
    if beta <= 0 or max_weight <= 0 or min_gain < 0:
        raise ValueError(f"expected beta > 0, max_weight > 0, min_gain >= 0; given {beta}, {max_weight}, {min_gain}")
    g = np.asarray(success_gain, np.float64)
    adv = g - float(failure_gain)
    passed = g > max(float(failure_gain), 0.0) + float(min_gain)
    w = np.where(passed, np.minimum(np.exp(np.clip(adv / beta, -50.0, 50.0)), max_weight), 0.0)
    return passed, w
