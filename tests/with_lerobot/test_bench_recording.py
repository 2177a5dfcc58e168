"""scripts/bench_recording.py at a tiny size: real Meta-World episodes recorded by the store's writer and by
LeRobot's own LeRobotDataset (v3.0, AV1 video), the JSON has every figure, and both results read back the same
actions (each result opened here with its own reader: the store's, and LeRobot's LeRobotDataset)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lerobot.robots")
pytestmark = pytest.mark.lerobot

from experience_dict.store import ExperienceStore
from scripts.bench_recording import REPO_ID, main


def test_bench_recording_tiny(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    out, work = tmp_path / "r.json", tmp_path / "work"
    main(["--episodes", "2", "--steps", "24", "--image-size", "32", "--windows", "16", "--batch-size", "8",
          "--horizon", "4", "--dir", str(work), "--keep", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["episodes"]["count"] == 2 and r["episodes"]["steps"] == 24
    for side in ("store", "lerobot"):
        w = r["write"][side]
        assert w["total_s"] > 0 and w["episode_ms_median"] > 0 and w["total_s"] >= w["episodes_s"]
        assert r["disk"][side]["du_bytes"] > 0 and r["disk"][side]["apparent_bytes"] > 0
        assert r["read"][side]["windows_per_s"] > 0 and r["read"][side]["windows"] == 16
    assert r["read"]["store_cache_off"]["windows_per_s"] > 0
    assert r["disk"]["lerobot"]["by_top"]["videos"] > 0  # the camera went to video, not PNG
    ratios = r["ratios_store_over_lerobot"]
    assert ratios["write_s"] == pytest.approx(r["write"]["store"]["total_s"] / r["write"]["lerobot"]["total_s"])
    assert ratios["du_bytes"] == pytest.approx(r["disk"]["store"]["du_bytes"] / r["disk"]["lerobot"]["du_bytes"])
    assert ratios["windows_per_s"] > 0 and ratios["windows_per_s_cache_off"] > 0
    assert r["write"]["paired_lerobot_over_store"]["n"] == 2
    c = r["check"]
    assert c["actions_equal"] and c["states_equal"] and c["rewards_equal"] and c["store_images_equal"]
    assert 0 < c["lerobot_video_mae_grey_levels_ep0"] < 20  # lossy AV1 at LeRobot's CRF 30

    # both results, read here with their own readers, hold the same actions for an episode
    store = ExperienceStore.open(str(work / "store"))
    metas = store.episodes()
    assert [m.length for m in metas] == [24, 24]
    ds = LeRobotDataset(REPO_ID, root=work / "lerobot", video_backend="pyav")
    assert (ds.num_episodes, ds.num_frames) == (2, 48)
    assert ds.meta.features["observation.images.corner"]["dtype"] == "video"
    hf = ds.hf_dataset.with_format("numpy")
    row = ds.meta.episodes[1]
    lr_actions = np.asarray(hf[int(row["dataset_from_index"]):int(row["dataset_to_index"])]["action"], np.float32)
    np.testing.assert_array_equal(lr_actions, store.load_episode(metas[1].episode_id)["action"])
    assert not np.array_equal(lr_actions, store.load_episode(metas[0].episode_id)["action"])  # distinct episodes
