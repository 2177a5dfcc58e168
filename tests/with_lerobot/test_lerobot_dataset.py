"""LeRobotDataset v3.0 interop (experience_dict.lerobot): fixture import, store round trips, bad input.

Real inputs only: the two LeRobot 0.4.4 fixtures in tests/fixtures/lerobot_v3 (Meta-World push-v3 expert, AV1 video
and PNG images; their README gives lengths and provenance), a real Zarr store filled with real Meta-World
episodes (sim.make_env + sim.make_expert, 64x64 camera) and LeRobot's own LeRobotDataset to write and read.
Expected values come from the fixture README and from reading the parquet files directly with pyarrow/PIL.
LeRobot 0.6.1 is installed by ``make install``; ``make test`` runs these (``make test-lerobot`` runs them alone).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lerobot")
pytestmark = pytest.mark.lerobot
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pyarrow.parquet as pq
from PIL import Image

from experience_dict.lerobot import (
    EXTERNAL_UNIT_ID,
    SIDECAR,
    LeRobotInteropError,
    export_dataset,
    import_dataset,
    main,
)
from experience_dict.store import DEFAULT_PROGRESS_KEYS, ExperienceStore

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "lerobot_v3"
IMAGE_DS, VIDEO_DS = FIXTURES / "metaworld_push_image", FIXTURES / "metaworld_push_video"
README_LENGTHS = [74, 69, 66, 75, 69, 82]  # tests/fixtures/lerobot_v3/README.md
TASK_STRING = "push the puck to the goal"
CAM = "observation.images.corner2"


def parquet_episodes(root: Path) -> dict[int, dict[str, np.ndarray]]:
    """The fixture's data parquet read with pyarrow (not LeRobot): {episode: {column: (T, ...) array}}."""
    table = pq.read_table(root / "data" / "chunk-000" / "file-000.parquet").to_pydict()
    ep = np.asarray(table["episode_index"])
    out = {}
    for e in np.unique(ep):
        rows = np.nonzero(ep == e)[0]
        d = {"observation.state": np.asarray([table["observation.state"][i] for i in rows], np.float32),
             "action": np.asarray([table["action"][i] for i in rows], np.float32),
             "next.success": np.asarray([table["next.success"][i] for i in rows], bool)}
        if CAM in table:  # PNG bytes -> RGB uint8 with PIL
            d[CAM] = np.stack([np.asarray(Image.open(io.BytesIO(table[CAM][i]["bytes"])).convert("RGB")) for i in rows])
        out[int(e)] = d
    return out


@pytest.fixture(scope="module")
def fixture_store(tmp_path_factory):
    """Both fixtures imported into one store: the image one through the CLI (task renamed), the video one via
    the function. Returns (url, {"image": summary, "video": summary})."""
    url = str(tmp_path_factory.mktemp("fx") / "store")
    video = import_dataset(VIDEO_DS, url, progress=False)
    assert main(["import", str(IMAGE_DS), url, "--quiet", "--task-name", f"{TASK_STRING}=push-v3"]) == 0
    store = ExperienceStore.open(url)
    image_ids = [e.episode_id for e in store.episodes(shard="lerobot-local.metaworld_push_image")]
    return url, {"video": video, "image": {"episode_ids": image_ids}}


def test_import_fixtures(fixture_store, capsys):
    url, summaries = fixture_store
    store = ExperienceStore.open(url)
    assert store.control_hz == 80.0  # fixture fps
    assert store.features["observation.state"]["shape"] == [39]
    assert store.features[CAM]["shape"] == [96, 96, 3]
    assert store.progress_keys == list(DEFAULT_PROGRESS_KEYS)
    want = {"image": parquet_episodes(IMAGE_DS), "video": parquet_episodes(VIDEO_DS)}
    loaded = {}
    for kind, task in (("image", "push-v3"), ("video", TASK_STRING)):
        eps = [store.episode(i) for i in summaries[kind]["episode_ids"]]
        assert [e.length for e in eps] == README_LENGTHS and sum(e.length for e in eps) == 435
        for i, e in enumerate(eps):
            w = want[kind][i]
            assert e.task == task and e.success is bool(w["next.success"].any()) is True
            assert (e.unit_id, e.embodiment, e.is_demo, e.policy_version) == (EXTERNAL_UNIT_ID, "sawyer", True, -1)
            assert e.extra["lerobot"]["episode_index"] == i and e.extra["lerobot"]["task"] == TASK_STRING
            got = store.load_episode(e.episode_id)
            np.testing.assert_array_equal(got["observation.state"], w["observation.state"])
            np.testing.assert_array_equal(got["action"], w["action"])
            assert np.isnan(got["reward"]).all()  # no next.reward / progress columns: NaN, as documented
            assert all(np.isnan(got[f"progress.{k}"]).all() for k in store.progress_keys)
            loaded[kind, i] = got[CAM]
    for i in range(6):
        np.testing.assert_array_equal(loaded["image", i], want["image"][i][CAM])  # PNG: lossless
        vid, png = loaded["video", i].astype(np.float64), want["image"][i][CAM]
        err = np.abs(vid - png).mean()
        assert 0 < err < 5, err  # AV1: README measures ~3.1
        # frames are aligned: each decoded frame is nearer its own PNG than the PNG one step before / after
        aligned = np.abs(vid[1:-1] - png[1:-1]).mean()
        assert aligned < np.abs(vid[1:-1] - png[:-2]).mean() and aligned < np.abs(vid[1:-1] - png[2:]).mean()
    assert store.verify()["ok"]

    # re-running skips what is there (resumable import); nothing is added
    assert main(["import", str(IMAGE_DS), url, "--quiet", "--task-name", f"{TASK_STRING}=push-v3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["episodes"] == 0 and out["skipped"] == list(range(6))
    assert len(ExperienceStore.open(url)) == 12

    # dataset -> store -> dataset restores the LeRobot task string although the store calls the task push-v3
    out_dir = Path(url).parent / "again"
    res = export_dataset(url, out_dir, episode_ids=summaries["image"]["episode_ids"][:2], video=False, progress=False)
    assert res["tasks"] == {TASK_STRING: "push-v3"}
    assert pq.read_table(out_dir / "meta" / "tasks.parquet").to_pandas().index.tolist() == [TASK_STRING]


# ----------------------------------------------------------------------------- Meta-World store round trip


@pytest.fixture(scope="module")
def mw_store(tmp_path_factory):
    """A real store: 2 push-v3 expert successes (units 0 and 3) and 1 reach-v3 failure (cut at 12 steps) with
    a failure onset, rendered by a 64x64 'corner' camera. Returns the URL."""
    from sim import make_env, make_expert

    url = str(tmp_path_factory.mktemp("mw") / "store")
    obs_cfg = {"images": True, "cameras": ["corner"], "image_size": 64}
    runs = [("push-v3", 0, 0, 120), ("push-v3", 3, 1, 120), ("reach-v3", 0, 2, 12)]
    store = writer = None
    for task, unit, seed, horizon in runs:
        env = make_env(task, unit_id=unit, obs_cfg=obs_cfg,
                       task_cfg={"max_episode_steps": horizon, "steps_after_success": 5})
        if store is None:
            spec = env.spec_dict()
            store = ExperienceStore.create_or_open(url, spec=spec, control_hz=spec["control_hz"])
            writer = store.writer("unit-demo")
        expert = make_expert(env, noise_std=0.0, seed=seed)
        writer.begin_episode(unit_id=unit, embodiment=env.unit.embodiment, task=task, policy_version=-1, seed=seed,
                             is_demo=True, extra={"unit": env.unit.to_dict()})
        obs, info = env.reset(seed=seed)
        success = False
        while True:
            action = expert.act(obs)
            nxt, reward, terminated, truncated, info = env.step(action)
            writer.add_step(obs, action, float(reward), info["progress"])
            obs, success = nxt, success or bool(info["success"])
            if terminated or truncated:
                break
        writer.commit(success=success)
        env.close()
    writer.close()
    store.refresh()
    fail = store.episodes(success=False)
    assert [e.task for e in fail] == ["reach-v3"] and len(store.episodes(success=True)) == 2
    store.set_failure_onset(fail[0].episode_id, 5)
    return url


@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_round_trip_store_dataset_store(mw_store, tmp_path, video):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    src = ExperienceStore.open(mw_store)
    out_dir = tmp_path / "ds"
    res = export_dataset(mw_store, out_dir, repo_id="local/mw_rt", video=video,
                         task_strings={"push-v3": "push the puck to the goal"}, progress=False)
    assert res["episodes"] == 3 and res["fps"] == 80
    assert json.loads((out_dir / SIDECAR).read_text())["tasks"] == {"push the puck to the goal": "push-v3",
                                                                    "reach-v3": "reach-v3"}
    assert not (out_dir / "images").exists()  # LeRobot's temporary PNG folders are gone

    # LeRobot itself reads what was written: episodes, fps, tasks, features from the store spec, column values
    ds = LeRobotDataset("local/mw_rt", root=out_dir, video_backend="pyav")
    assert (ds.num_episodes, ds.num_frames, ds.fps) == (3, sum(e.length for e in src.episodes()), 80)
    assert sorted(ds.meta.tasks.index) == ["push the puck to the goal", "reach-v3"]
    feats = ds.meta.features
    assert feats["observation.images.corner"]["dtype"] == ("video" if video else "image")
    assert feats["observation.images.corner"]["shape"] == (64, 64, 3)
    assert feats["action"]["names"] == src.spec["action"]["names"] == ["dx", "dy", "dz", "gripper"]
    assert feats["observation.environment_state"]["shape"] == (17,)
    hf = ds.hf_dataset.with_format("numpy")
    first = src.load_episode(src.episodes()[0].episode_id)
    T0 = len(first["action"])
    np.testing.assert_array_equal(hf[0:T0]["action"], first["action"])
    np.testing.assert_array_equal(hf[0:T0]["next.success"], np.arange(T0) == T0 - 1)  # success on the last frame
    if not video:
        np.testing.assert_array_equal((ds[3]["observation.images.corner"].permute(1, 2, 0).numpy() * 255).round(),
                                      first["observation.images.corner"][3])
    else:  # LeRobot's own PyAV decoder
        img = (ds[3]["observation.images.corner"].permute(1, 2, 0).numpy() * 255).round()
        assert np.abs(img - first["observation.images.corner"][3]).mean() < 5

    # ... and back into a new store
    dst_url = str(tmp_path / "back")
    back = import_dataset(out_dir, dst_url, progress=False)
    assert back["episodes"] == 3 and back["created_store"]
    dst = ExperienceStore.open(dst_url)
    assert dst.control_hz == src.control_hz == 80.0
    assert dst.progress_keys == src.progress_keys
    assert {k: (f["shape"], f["dtype"]) for k, f in dst.features.items()} == \
           {k: (f["shape"], f["dtype"]) for k, f in src.features.items()}
    assert dst.spec["action"] == src.spec["action"] and dst.spec["observation.state"] == src.spec["observation.state"]
    for a, b in zip(src.episodes(), dst.episodes(), strict=True):
        for field in ("task", "unit_id", "embodiment", "policy_version", "seed", "length", "success", "is_demo",
                      "failure_onset", "start_time"):
            assert getattr(a, field) == getattr(b, field), field
        assert b.extra["unit"] == a.extra["unit"] and b.extra["lerobot"]["source_episode_id"] == a.episode_id
        x, y = src.load_episode(a.episode_id), dst.load_episode(b.episode_id)
        for key in x:
            if key == "observation.images.corner" and video:
                err = np.abs(x[key].astype(np.float64) - y[key]).mean()
                assert err < 5, err
            else:  # bit-exact: states, actions, reward, progress, PNG images
                assert x[key].dtype == y[key].dtype and x[key].tobytes() == y[key].tobytes(), key
    assert dst.episodes(success=False)[0].failure_onset == 5


# ----------------------------------------------------------------------------- bad input


def test_not_a_dataset(tmp_path, capsys):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a dataset")
    with pytest.raises(LeRobotInteropError, match="is not a LeRobotDataset.*info.json"):
        import_dataset(junk, str(tmp_path / "s"), progress=False)
    with pytest.raises(LeRobotInteropError, match="is not a directory"):
        import_dataset(tmp_path / "missing", str(tmp_path / "s"), progress=False)
    assert main(["import", str(junk), str(tmp_path / "s"), "--quiet"]) == 1
    assert "is not a LeRobotDataset" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # nothing created for bad input
    old = tmp_path / "old"
    shutil.copytree(IMAGE_DS, old)
    info = json.loads((old / "meta" / "info.json").read_text())
    (old / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v2.1"}))
    with pytest.raises(LeRobotInteropError, match="codebase_version 'v2.1'"):
        import_dataset(old, str(tmp_path / "s"), progress=False)


def test_conflicts_leave_the_store_intact(fixture_store, mw_store, tmp_path):
    url, _ = fixture_store
    before = ExperienceStore.open(url)
    n, ids = len(before), [e.episode_id for e in before.episodes()]
    # a dataset at another fps than the store's control_hz goes into a copy of the store with its rate kept per
    # episode (a mixed fleet); exporting both rates at once is refused, one rate at a time works
    ds40, mixed = tmp_path / "push40", str(tmp_path / "mixed")
    shutil.copytree(IMAGE_DS, ds40)
    info = json.loads((ds40 / "meta" / "info.json").read_text())
    (ds40 / "meta" / "info.json").write_text(json.dumps({**info, "fps": 40}))
    shutil.copytree(url, mixed)
    import_dataset(ds40, mixed, progress=False)
    ms = ExperienceStore.open(mixed)
    rates = {e.episode_id: ms.episode_hz(e) for e in ms.episodes()}
    assert sorted(set(rates.values())) == [40.0, 80.0] and sum(r == 40.0 for r in rates.values()) == len(ms) - n
    with pytest.raises(LeRobotInteropError, match=r"recorded at \[40.0, 80.0\] Hz"):
        export_dataset(mixed, tmp_path / "both", progress=False)
    assert not (tmp_path / "both").exists()
    only40 = [i for i, r in rates.items() if r == 40.0]
    assert export_dataset(mixed, tmp_path / "only40", episode_ids=only40, progress=False)["fps"] == 40
    # features that differ from the store spec (39-d Meta-World state vs the sim's 4-d state + 17-d env state)
    with pytest.raises(LeRobotInteropError, match="observation"):
        import_dataset(IMAGE_DS, mw_store, progress=False)
    # export into a non-empty folder / with a selection matching nothing
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        export_dataset(url, tmp_path / "full", progress=False)
    with pytest.raises(LeRobotInteropError, match="no episode"):
        export_dataset(url, tmp_path / "none", success=False, progress=False)
    assert not (tmp_path / "none").exists()
    after = ExperienceStore.open(url)
    assert len(after) == n and [e.episode_id for e in after.episodes()] == ids
    assert after.shards() == before.shards() and after.verify()["ok"]
    assert len(ExperienceStore.open(mw_store)) == 3


def test_lerobot_is_imported_lazily_and_its_absence_is_explained(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        import experience_dict, experience_dict.store, experience_dict.lerobot as lr
        assert "lerobot" not in sys.modules, "importing experience_dict imported lerobot"
        sys.modules["lerobot"] = None  # as if lerobot were not installed
        try:
            lr.import_dataset({str(IMAGE_DS)!r}, {str(tmp_path / "s")!r}, progress=False)
        except ImportError as e:
            print(e)
        else:
            raise SystemExit("no ImportError")
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'fleetmind[lerobot]'" in out.stdout and "make install" in out.stdout


def test_round_trip_keeps_retry_links_and_terminations(tmp_path):
    """A retry's ``retry_of`` names its episode in the store it is imported into (the source id kept under
    ``extra.lerobot.source_retry_of``), whatever order the dataset holds them in; ``termination`` comes back."""
    from tests.test_store import PROGRESS, SPEC, make_step

    url = str(tmp_path / "src")
    w = ExperienceStore.create_or_open(url, SPEC, progress_keys=PROGRESS, chunk_bytes=4096).writer("unit-0000")
    ids = []
    for k, (ok, why, extra) in enumerate([(False, "truncated", {}), (False, "truncated", {"attempt": 0}),
                                          (True, "terminated", {"attempt": 1})]):
        if k:
            extra = {**extra, "retry_of": ids[-1]}
        w.begin_episode(unit_id=0, embodiment="sawyer", task="reach-v3", policy_version=1, seed=7, is_demo=False,
                        extra=extra)
        for t in range(6):
            w.add_step(*make_step(0, k, t))
        ids.append(w.commit(success=ok, termination=why))
    w.close()
    out_dir = tmp_path / "ds"
    export_dataset(url, out_dir, repo_id="local/retries", episode_ids=list(reversed(ids)), video=False, progress=False)
    dst_url = str(tmp_path / "back")
    import_dataset(out_dir, dst_url, progress=False)
    dst = {e.extra["lerobot"]["source_episode_id"]: e for e in ExperienceStore.open(dst_url).episodes()}
    assert set(dst) == set(ids)
    first, retry0, retry1 = (dst[i] for i in ids)
    assert first.termination == "truncated" and retry1.termination == "terminated"
    assert "retry_of" not in first.extra
    assert retry0.extra["retry_of"] == first.episode_id and retry1.extra["retry_of"] == retry0.episode_id
    assert retry1.extra["lerobot"]["source_retry_of"] == ids[1] and retry1.extra["attempt"] == 1


def test_lerobot_dataset_viz_runs_in_the_one_environment(tmp_path):
    """Issue 52, item 14: LeRobot's viewer (``lerobot-dataset-viz``, rerun-sdk from LeRobot's viz extra) runs on a
    LeRobotDataset v3 folder offline and writes a Rerun recording with ``--save 1`` (no viewer spawned)."""
    exe = shutil.which("lerobot-dataset-viz") or str(Path(sys.executable).parent / "lerobot-dataset-viz")
    out = tmp_path / "viz"
    p = subprocess.run([exe, "--repo-id", "local/metaworld_push_expert", "--root", str(IMAGE_DS), "--episode-index",
                        "1", "--save", "1", "--output-dir", str(out), "--num-workers", "0"],
                       env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    [rrd] = list(out.glob("*.rrd"))
    assert rrd.stat().st_size > 10_000


def test_export_command_prints_no_torchcodec_traceback(tmp_path):
    """Issue 52, item 12: ``python -m experience_dict.lerobot export`` on a machine whose torchcodec cannot load
    FFmpeg's shared libraries: LeRobot's ~100-line traceback is replaced by one logged line; the dataset is written
    (PNG frames: the test store's 16 px frames are below what the AV1 encoder takes)."""
    from tests.test_store import new_store, write_episode

    w = new_store(tmp_path / "store").writer("u0")
    for e in range(2):
        write_episode(w, 0, e)
    w.close()
    p = subprocess.run([sys.executable, "-m", "experience_dict.lerobot", "export", str(tmp_path / "store"),
                        str(tmp_path / "ds"), "--no-video"], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "libtorchcodec" not in out and "Traceback" not in out, out[:3000]
    assert (tmp_path / "ds" / "meta" / "info.json").is_file()


def test_video_export_of_frames_too_narrow_for_svtav1_is_refused_before_anything_is_written(tmp_path):
    """SVT-AV1 kills the process with SIGFPE on frames under 25 px wide (measured): the AV1 export refuses them with
    a named error and leaves no dataset; h264 or PNG frames remain the way out."""
    from tests.test_store import new_store, write_episode

    w = new_store(tmp_path / "store").writer("u0")
    write_episode(w, 0, 0)
    w.close()
    with pytest.raises(LeRobotInteropError, match="narrower than SVT-AV1 encodes"):
        export_dataset(str(tmp_path / "store"), tmp_path / "ds", progress=False)
    assert not (tmp_path / "ds").exists()
    p = subprocess.run([sys.executable, "-m", "experience_dict.lerobot", "export", str(tmp_path / "store"),
                        str(tmp_path / "ds")], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode != 0 and p.returncode != -8 and "narrower than SVT-AV1" in p.stderr + p.stdout
