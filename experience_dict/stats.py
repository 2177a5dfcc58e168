"""Mergeable per-episode statistics for normalization (min, max, mean, std, q01, q99 per dimension).

Every committed episode carries a small *sketch* per feature key (computed by the writer, which holds the
episode in memory anyway), so the store's normalization statistics are recomputed incrementally: merging
sketches never reads array data.

Sketch of one episode and one key, all lists over the key's feature dimensions ``D`` (``D = 1`` for scalar
keys such as ``reward``; ``D = C`` colour channels for images, pixel values 0..255):

- ``n``: number of values per dimension (steps, or steps x pixels for images)
- ``mean``, ``m2``: mean and sum of squared deviations, merged with Chan et al.'s parallel update
  (Chan, Golub & LeVeque 1979, "Updating formulae and a pairwise algorithm for computing sample variances")
- ``min``, ``max``
- ``q``: the episode's quantiles at :data:`QGRID` (``len(QGRID) x D``; Hazen plotting positions, so the
  piecewise-linear CDF through them is within ``1 / (2 n)`` in rank of the episode's empirical CDF), spaced
  0.5-1 % in the tails and 5 % in the body

Quantiles are merged by inverting the mixture of the episodes' piecewise-linear CDFs (each episode weighted
by its count), the same idea as merging t-digest centroids (Dunning & Ertl 2019). The merged q01/q99 are
approximate: rank error at most the local grid spacing plus ``1 / (2 n)`` (about 1 % for episodes of 150
steps whose tails hold the quantile); min, max, mean and std are exact (up to float64 rounding).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

Z_95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson, 1927; Brown, Cai & DasGupta, 2001).

    Args:
        successes: number of successful trials, ``0 <= successes <= trials``.
        trials: number of trials; ``0`` gives the uninformative interval ``(0.0, 1.0)``.
        z: normal quantile (1.96 for 95%).

    Returns:
        ``(low, high)`` bounds in [0, 1].

    Raises:
        ValueError: if the counts are negative or ``successes > trials``.
    """
    if trials < 0 or successes < 0 or successes > trials:
        raise ValueError(f"wilson_interval needs 0 <= successes <= trials, got {successes}/{trials}")
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    denom = 1.0 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


QGRID = np.concatenate([[0.0, 0.005, 0.01, 0.02, 0.03, 0.05], np.linspace(0.1, 0.9, 17),
                        [0.95, 0.97, 0.98, 0.99, 0.995, 1.0]])
STAT_NAMES = ("min", "max", "mean", "std", "q01", "q99")
IMAGE_STRIDE = 4  # image statistics use every 4th pixel row and column


def _f32_list(x: np.ndarray) -> list:
    """Values rounded to float32, as (nested) lists of Python floats holding those float32 values exactly."""
    return np.asarray(x, dtype=np.float32).tolist()


def episode_sketch(values: np.ndarray, is_image: bool = False) -> dict:
    """Sketch of one episode's values of one key.

    Args:
        values: ``(T, *shape)`` array of one key for one episode (any numeric dtype). For images pass
            ``(T, H, W, C)`` uint8 with ``is_image=True``: statistics are then per channel over all pixels.
        is_image: treat the last axis as channels and pool every other axis (uint8 ``(T, H, W, C)``: every
            :data:`IMAGE_STRIDE`-th pixel row and column).

    Returns:
        JSON-able dict ``{"n", "mean", "m2", "min", "max", "q"}`` (see module docstring), plus ``"nan"``
        (per-dimension NaN counts) when there are NaNs: every statistic is of the non-NaN values.

    Raises:
        ValueError: if ``values`` is empty or not numeric.
    """
    values = np.asarray(values)
    if values.size == 0:
        raise ValueError(f"cannot sketch an empty array (shape {values.shape})")
    if not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
        raise ValueError(f"cannot sketch non-numeric dtype {values.dtype}")
    if is_image and values.dtype == np.uint8:
        # statistics of every 4th pixel row and column (as LeRobot, images are downsampled for stats; 576
        # pixels of a 96x96 frame), exact for that subsample from a 256-bin histogram per channel (no sort)
        sub = values[:, ::IMAGE_STRIDE, ::IMAGE_STRIDE] if values.ndim == 4 else values
        return histogram_sketch(pixel_histogram(np.ascontiguousarray(sub).reshape(-1, sub.shape[-1])))
    if is_image:
        flat = values.reshape(-1, values.shape[-1])
    else:
        flat = values.reshape(values.shape[0], -1)
    flat64 = np.sort(flat.astype(np.float64), axis=0)   # NaNs sort last
    n = flat64.shape[0]
    nan = np.isnan(flat64).sum(0)                        # (D,) NaN is "no value" (e.g. no progress signal)
    k = n - nan                                          # (D,) values per dimension
    cols = np.arange(flat64.shape[1])
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nansum(flat64, 0) / k                  # NaN where a dimension has no value
        m2 = np.nansum((flat64 - mean) ** 2, 0)
        # Hazen quantiles (numpy.quantile(method="hazen"): virtual index k p - 1/2, clipped, linear
        # interpolation) of each dimension's k values, from one sort instead of a numpy.quantile call per key
        last = np.maximum(k - 1, 0)
        pos = np.clip(k[None, :] * QGRID[:, None] - 0.5, 0, last[None, :])   # (G, D)
        i0 = np.floor(pos).astype(np.int64)
        i1 = np.minimum(i0 + 1, last[None, :])
        q = flat64[i0, cols] + (pos - i0) * (flat64[i1, cols] - flat64[i0, cols])  # (G, D)
    empty = k == 0
    q[:, empty] = np.nan
    lo, hi = flat64[0].copy(), flat64[last, cols]
    lo[empty] = hi[empty] = np.nan
    out = {"n": int(n), "mean": mean.tolist(), "m2": np.where(empty, np.nan, m2).tolist(), "min": _f32_list(lo),
           "max": _f32_list(hi), "q": _f32_list(q)}
    if nan.any():
        out["nan"] = nan.astype(int).tolist()
    return out


def pixel_histogram(pixels: np.ndarray) -> np.ndarray:
    """Counts of each value 0..255 per channel: ``(N, C)`` uint8 pixels -> ``(256, C)`` int64.

    The sufficient statistic of an image sketch: histograms of parts of an episode add up to the episode's
    (the store's writer counts each chunk's pixels in its chunk writers and sums them at commit).
    """
    if pixels.dtype != np.uint8 or pixels.ndim != 2:
        raise ValueError(f"pixel_histogram: expected (N, C) uint8 pixels, given {pixels.dtype} {pixels.shape}")
    return np.stack([np.bincount(pixels[:, c], minlength=256) for c in range(pixels.shape[1])], 1).astype(np.int64)


def histogram_sketch(hist: np.ndarray) -> dict:
    """The :func:`episode_sketch` of uint8 image values from their ``(256, C)`` :func:`pixel_histogram` (exact:
    mean and m2 from the counts, min/max the lowest/highest level present, quantiles by inverting the CDF).

    Raises:
        ValueError: a histogram of another shape, or with no pixels.
    """
    if hist.ndim != 2 or hist.shape[0] != 256 or hist[:, 0].sum() <= 0:
        raise ValueError(f"histogram_sketch: expected (256, C) counts of at least one pixel, given {hist.shape}")
    hist = hist.astype(np.float64)
    n = hist[:, 0].sum()
    levels = np.arange(256, dtype=np.float64)[:, None]
    mean = (hist * levels).sum(0) / n
    m2 = (hist * (levels - mean) ** 2).sum(0)
    nz = hist > 0
    lo = nz.argmax(0).astype(np.float64)
    hi = (255 - nz[::-1].argmax(0)).astype(np.float64)
    cdf = np.cumsum(hist, 0) / n
    q = np.stack([np.searchsorted(cdf[:, i], QGRID * (1 - 1e-12)) for i in range(hist.shape[1])], 1)
    q = np.clip(q.astype(np.float64), lo, hi)
    q[0], q[-1] = lo, hi
    return {"n": int(n), "mean": mean.tolist(), "m2": m2.tolist(), "min": lo.tolist(), "max": hi.tolist(),
            "q": q.tolist()}


def _mixture_quantile(qpts: np.ndarray, weights: np.ndarray, p: float) -> float:
    """Quantile ``p`` of a mixture of piecewise-linear CDFs.

    Args:
        qpts: ``(E, G)`` non-decreasing quantile points of E components at :data:`QGRID`.
        weights: ``(E,)`` component weights (counts).
        p: probability in [0, 1].
    """
    if len(qpts) == 1:
        return float(np.interp(p, QGRID, qpts[0]))
    w = weights / weights.sum()
    cand = np.unique(qpts)

    def cdf(x: float) -> float:
        # per component: linear interpolation of QGRID over its quantile points (vectorised over E)
        j = (qpts <= x).sum(1)  # number of points <= x, in 0..G
        lo = np.clip(j - 1, 0, qpts.shape[1] - 1)
        hi = np.clip(j, 0, qpts.shape[1] - 1)
        xl, xh = qpts[np.arange(len(qpts)), lo], qpts[np.arange(len(qpts)), hi]
        frac = np.where(xh > xl, (x - xl) / np.where(xh > xl, xh - xl, 1.0), 1.0)
        val = np.where(j == 0, 0.0, np.where(j >= qpts.shape[1], 1.0, QGRID[lo] + frac * (QGRID[hi] - QGRID[lo])))
        return float((w * val).sum())

    lo_i, hi_i = 0, len(cand) - 1
    if cdf(cand[0]) >= p:
        return float(cand[0])
    while hi_i - lo_i > 1:  # bisection over the sorted candidate points: cdf(cand[lo]) < p <= cdf(cand[hi])
        mid = (lo_i + hi_i) // 2
        if cdf(cand[mid]) < p:
            lo_i = mid
        else:
            hi_i = mid
    a, b = cand[lo_i], cand[hi_i]
    fa, fb = cdf(a), cdf(b)
    return float(a + (p - fa) / (fb - fa) * (b - a)) if fb > fa else float(b)


def merge_sketches(sketches: list[dict]) -> dict[str, list[float]]:
    """Merge episode sketches of one key into normalization statistics.

    Args:
        sketches: non-empty list of :func:`episode_sketch` outputs of the same key (same D).

    Returns:
        ``{"min", "max", "mean", "std", "q01", "q99", "count", "nan_count"}``: per-dimension lists of floats
        (``count`` is an int: the values per dimension, NaN included; ``nan_count`` per dimension). NaN is "no
        value" (the documented "no signal" of reward and progress keys): every statistic skips it, and a
        dimension with no value at all gets NaN. ``std`` is the population standard deviation.

    Raises:
        ValueError: if ``sketches`` is empty or the sketches disagree on the number of dimensions.
    """
    if not sketches:
        raise ValueError("no episodes to compute statistics from")
    dims = {len(s["mean"]) for s in sketches}
    if len(dims) != 1:
        raise ValueError(f"sketches disagree on the number of dimensions: {sorted(dims)}")
    d = dims.pop()
    nan = np.array([s["nan"] if s.get("nan") is not None else [0] * d for s in sketches], dtype=np.float64)  # (E, D)
    n = np.array([s["n"] for s in sketches], dtype=np.float64)[:, None] - nan          # (E, D) values
    has = n > 0
    means = np.where(has, np.array([s["mean"] for s in sketches], dtype=np.float64), 0.0)  # (E, D)
    m2s = np.where(has, np.array([s["m2"] for s in sketches], dtype=np.float64), 0.0)
    total = n.sum(0)                                                                    # (D,)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (n * means).sum(0) / total
        # Chan et al.: M2 = sum_e M2_e + sum_e n_e (mean_e - mean)^2
        m2 = m2s.sum(0) + (n * (means - mean) ** 2).sum(0)
        std = np.sqrt(np.maximum(m2 / total, 0.0))
    q = np.array([s["q"] for s in sketches], dtype=np.float64)  # (E, G, D)
    q01 = [_mixture_quantile(q[has[:, j], :, j], n[has[:, j], j], 0.01) if has[:, j].any() else math.nan
           for j in range(d)]
    q99 = [_mixture_quantile(q[has[:, j], :, j], n[has[:, j], j], 0.99) if has[:, j].any() else math.nan
           for j in range(d)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # a dimension with no value in any episode -> NaN
        lo = np.nanmin(np.array([s["min"] for s in sketches], dtype=np.float64), 0)
        hi = np.nanmax(np.array([s["max"] for s in sketches], dtype=np.float64), 0)
    return {
        "min": lo.tolist(),
        "max": hi.tolist(),
        "mean": mean.tolist(),
        "std": std.tolist(),
        "q01": q01,
        "q99": q99,
        "count": int(sum(s["n"] for s in sketches)),
        "nan_count": nan.sum(0).astype(int).tolist(),
    }
