"""The store's image codecs (experience_dict/store/codecs.py) on real Meta-World renders in real zarr stores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from experience_dict.store import CorruptChunkError, ExperienceStore, copy_episodes
from experience_dict.store.codecs import FRAME_DELTA, VIDEO, FrameDeltaCodec, VideoChunkCodec
from scripts.bench_store import sim_episodes, write_store_episode

CAM = "observation.images.corner"
STEPS, SIZE = 40, 48


@pytest.fixture(scope="module")
def renders():
    """Two real push-v3 expert episodes, 40 steps of a 48 x 48 corner render each."""
    return sim_episodes(2, STEPS, SIZE, task="push-v3")


def write(url: Path, spec: dict, eps: list[dict], **layout) -> ExperienceStore:
    # 4 frames a chunk, so an episode spans 10 chunks and reads cross chunk boundaries
    store = ExperienceStore.create_or_open(str(url), spec, progress_keys=list(eps[0]["progress"][0]),
                                           chunk_bytes=4 * SIZE * SIZE * 3, **layout)
    w = store.writer("u0")
    for i, ep in enumerate(eps):
        write_store_episode(w, ep["obs"], ep["actions"], ep["rewards"], ep["progress"], seed=i)
    w.close()
    return ExperienceStore.open(str(url))


def codec_names(url: Path, shard: str = "u0") -> list[str]:
    meta = json.loads((url / "shards" / shard / CAM / "zarr.json").read_text())
    return [c["name"] for c in meta["codecs"]]


def image_bytes(url: Path) -> int:
    return sum(p.stat().st_size for p in (url / "shards/u0" / CAM).glob("c.*"))


def test_image_codecs_round_trip_real_renders(tmp_path, renders):
    """delta-zstd (the default) and zstd give the frames back bit for bit; delta-zstd is smaller than zstd on real
    renders; h264 gives them back within a few grey levels and is smaller still; zarr.json names each chain."""
    spec, eps = renders
    want = [np.stack([o[CAM] for o in ep["obs"]]) for ep in eps]
    got, size = {}, {}
    for codec in ("zstd", "delta-zstd", "h264"):
        url = tmp_path / codec
        store = write(url, spec, eps, image_codec=codec)
        got[codec] = [store.load_episode(m.episode_id)[CAM] for m in store.episodes()]
        size[codec] = image_bytes(url)
        assert store.meta["image_codec"] == codec
    assert codec_names(tmp_path / "zstd") == ["bytes", "blosc", "crc32c"]
    assert codec_names(tmp_path / "delta-zstd") == [FRAME_DELTA, "bytes", "blosc", "crc32c"]
    assert codec_names(tmp_path / "h264") == [VIDEO, "crc32c"]
    for codec in ("zstd", "delta-zstd"):
        for g, w in zip(got[codec], want, strict=True):
            np.testing.assert_array_equal(g, w)
    for g, w in zip(got["h264"], want, strict=True):
        assert g.shape == w.shape and g.dtype == np.uint8
        mae = np.abs(g.astype(np.float64) - w).mean()
        assert 0 < mae < 6, mae
    assert size["delta-zstd"] < size["zstd"], size
    assert size["h264"] < size["delta-zstd"], size
    # the default for a new store is delta-zstd; an existing store keeps the layout it was made with
    assert ExperienceStore.create_or_open(str(tmp_path / "new"), spec).meta["image_codec"] == "delta-zstd"
    reopened = ExperienceStore.create_or_open(str(tmp_path / "zstd"), spec, image_codec="h264")
    w = reopened.writer("u1")
    write_store_episode(w, eps[0]["obs"], eps[0]["actions"], eps[0]["rewards"], eps[0]["progress"], seed=9)
    w.close()
    assert codec_names(tmp_path / "zstd", "u1") == ["bytes", "blosc", "crc32c"]
    # a copy keeps its source's codec
    src = ExperienceStore.open(str(tmp_path / "h264"))
    copy_episodes(src, str(tmp_path / "copy"), src.episodes()[:1])
    assert codec_names(tmp_path / "copy", "copy") == [VIDEO, "crc32c"]


def test_h264_store_trains_and_still_catches_a_chunk_of_another_place(tmp_path, renders):
    """Training windows read from an h264 store (the rows check takes the lossy frames); a chunk file copied
    over from an episode of unlike frames is still named as corrupt."""
    from experience_dict.sampler import WindowDataset

    spec, eps = renders
    dark = {**eps[1], "obs": [{**o, CAM: (o[CAM] // 4).astype(np.uint8)} for o in eps[1]["obs"]]}
    url = tmp_path / "h264"
    store = write(url, spec, [eps[0], dark], image_codec="h264")
    ds = WindowDataset(store, windows={CAM: (CAM, [-1, 0]), "action": ("action", list(range(4)))})
    item = ds[len(ds) // 2]
    assert tuple(item[CAM].shape)[-3:] in ((SIZE, SIZE, 3), (3, SIZE, SIZE))
    first, second = store.episodes()
    cr = store.array("u0", CAM).chunks[0]
    src = url / "shards/u0" / CAM / f"c.{second.start // cr}.0.0.0"
    dst = url / "shards/u0" / CAM / f"c.{first.start // cr + 1}.0.0.0"
    shutil.copyfile(src, dst)
    with pytest.raises(CorruptChunkError, match="mean differs"):
        ExperienceStore.open(str(url)).load_episode(first.episode_id)


def test_codec_arguments_are_checked(tmp_path, renders):
    spec, _ = renders
    with pytest.raises(ValueError, match="image_codec must be one of"):
        ExperienceStore.create_or_open(str(tmp_path / "a"), spec, image_codec="png")
    with pytest.raises(ValueError, match="image_crf must be 0..51"):
        ExperienceStore.create_or_open(str(tmp_path / "b"), spec, image_crf=60)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()   # nothing made on a refusal
    with pytest.raises(ValueError, match="crf must be 0..51"):
        VideoChunkCodec(crf=-1)
    with pytest.raises(ValueError, match="even frame sizes"):
        VideoChunkCodec().validate(shape=(8, 33, 32, 3), dtype=np.dtype("uint8"), chunk_grid=None)
    with pytest.raises(ValueError, match=r"\(T, H, W, C\) uint8"):
        FrameDeltaCodec().validate(shape=(8, 4), dtype=np.dtype("float32"), chunk_grid=None)


def test_an_odd_camera_size_takes_yuv444p_or_is_refused_before_anything_is_made(tmp_path):
    """``obs.image_size`` 25 with ``store.image_codec=h264``: yuv420p (the default) is refused by the config check
    and by ``create_or_open`` (a ``SpecMismatchError``, a ``StoreError``, nothing created); ``image_pix_fmt=
    yuv444p`` stores and reads it back (issue 52, item 4)."""
    from configs.schema import problems
    from experience_dict.store import StoreError

    odd = sim_episodes(1, 12, 25, task="push-v3")
    spec, eps = odd
    with pytest.raises(StoreError, match=r"even frame sizes; observation.images.corner is 25x25.*image_pix_fmt"):
        write(tmp_path / "a", spec, eps, image_codec="h264")
    assert not (tmp_path / "a").exists()
    store = write(tmp_path / "b", spec, eps, image_codec="h264", image_pix_fmt="yuv444p")
    (e,) = store.episodes()
    got = store.load_episode(e.episode_id, keys=[CAM])[CAM]
    want = np.stack([o[CAM] for o in eps[0]["obs"]])
    assert got.shape == want.shape and np.abs(got.astype(float) - want).mean() < 8   # lossy, as the reader allows
    assert store.meta["image_pix_fmt"] == "yuv444p"
    cfg = {"obs": {"images": True, "image_size": 25}, "store": {"image_codec": "h264"}}
    assert any("needs an even obs.image_size, given 25" in p for p in problems(cfg))
    cfg["store"]["image_pix_fmt"] = "yuv444p"
    assert not any("image_pix_fmt" in p for p in problems(cfg))


def test_h264_saturated_colour_detail_is_not_reported_corrupt(tmp_path, renders):
    """Issue 52, item 5: 20 frames of a red / green checker (4:2:0 chroma subsampling moves the blue mean ~18 grey
    levels) read back from an h264 store without a CorruptChunkError, and ``verify`` lists nothing; the luma check
    still names a chunk of darker frames (the test above)."""
    spec, eps = renders
    ep = eps[0]
    checker = np.zeros((SIZE, SIZE, 3), np.uint8)
    ii, jj = np.indices((SIZE, SIZE))
    checker[(ii + jj) % 2 == 0] = (255, 0, 0)
    checker[(ii + jj) % 2 == 1] = (0, 255, 0)
    sat = {**ep, "obs": [{**o, CAM: checker.copy()} for o in ep["obs"][:20]], "actions": ep["actions"][:20],
           "rewards": ep["rewards"][:20], "progress": ep["progress"][:20]}
    store = write(tmp_path / "sat", spec, [sat], image_codec="h264")
    (m,) = store.episodes()
    frames = store.load_episode(m.episode_id)[CAM]
    assert frames.shape == (20, SIZE, SIZE, 3)
    rep = store.verify()
    assert rep["ok"] and not rep["corrupt_episodes"], rep
