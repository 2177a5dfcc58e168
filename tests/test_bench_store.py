"""scripts/bench_store.py's write benchmark on a real Zarr store in a temp dir (small synthetic renders): both
sides write every episode, the store reads them back, and the paired statistics are what they claim."""

import numpy as np
import pytest

from experience_dict.store import ExperienceStore
from scripts.bench_store import bench_write_repeated, paired_write_ratio, synthetic_frames


def test_paired_write_ratio_on_known_times():
    # numpy.save / store per episode: 2, 1, 0.5 -> median 1; numpy's fastest decile (2 s) over the store's median (2 s)
    out = paired_write_ratio([1.0, 2.0, 4.0], [2.0, 2.0, 2.0])
    assert out["paired_ratio_median"] == pytest.approx(1.0)
    assert out["ratio_vs_fast_numpy"] == pytest.approx(1.0)
    lo, hi = out["paired_ratio_ci95"]
    assert 0.5 <= lo <= 1.0 <= hi <= 2.0 and out["episodes"] == 3
    # a store twice as slow as numpy.save on every episode
    assert paired_write_ratio([2.0] * 5, [1.0] * 5)["paired_ratio_median"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="equal non-empty"):
        paired_write_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="equal non-empty"):
        paired_write_ratio([], [])


def test_bench_write_writes_both_sides_and_reads_back(tmp_path):
    spec, obs, actions = synthetic_frames(steps=12, size=24)
    scfg = {"chunk_bytes": 1 << 14, "max_chunk_rows": 64, "image_clevel": 1}
    res, url = bench_write_repeated({"episodes": 3, "repeats": 2}, tmp_path, spec, obs, actions, scfg)
    assert res["repeats"] == 2 and len(res["ratio_zarr_over_numpy_runs"]) == 2
    assert res["paired"]["episodes"] == 6 and res["paired"]["paired_ratio_median"] > 0
    assert "episode_wall_s" not in res  # per-episode times are summarised, not dumped
    store = ExperienceStore.open(url)  # the kept store (the median run's) holds every episode, readable
    eps = store.episodes()
    assert len(eps) == 3 and all(e.length == 12 for e in eps)
    img = store.load_episode(eps[1].episode_id, keys=["observation.images.corner"])["observation.images.corner"]
    np.testing.assert_array_equal(img, np.stack([o["observation.images.corner"] for o in obs]))
    assert not list(tmp_path.glob("write*/npy"))  # numpy.save's files are removed after each run


def test_bench_rows_check_runs_both_sides_on_a_real_store(tmp_path):
    """bench_rows_check: checked and unchecked sampling both read real windows of a real store, with the chunk
    cache and without it, and each run says which side it was."""
    from scripts.bench_store import bench_rows_check, bench_sampling

    spec, obs, actions = synthetic_frames(steps=40, size=24)
    scfg = {"chunk_bytes": 1 << 14, "max_chunk_rows": 64, "image_clevel": 1}
    _, url = bench_write_repeated({"episodes": 3, "repeats": 1}, tmp_path, spec, obs, actions, scfg)
    cfg = {"windows": 64, "batch_size": 16}
    rows = bench_rows_check(url, cfg, repeats=1)
    assert [r["cache_MB"] for r in rows] == [pytest.approx(1073.741824), 0.0]
    assert all(r["windows_per_s_checked"] > 0 and r["windows_per_s_unchecked"] > 0 for r in rows)
    assert bench_sampling(url, cfg, 0, 0, True, check_rows=False)["rows_checked"] is False
