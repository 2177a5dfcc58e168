"""Experience store: round trip, concurrent writer processes, SIGKILL recovery, refresh, corruption, bad input.

Real Zarr stores in tmp dirs (and memory://); small synthetic episodes whose content is a pure function of
(writer, episode, step), so any process can check what another wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from experience_dict.stats import IMAGE_STRIDE
from experience_dict.store import (
    LOWDIM,
    SCHEMA_VERSION,
    EpisodeMeta,
    ExperienceStore,
    NonFiniteError,
    SchemaVersionError,
    SpecMismatchError,
    StoreError,
    StoreWriteError,
    WriterBusyError,
)
from experience_dict.store.__main__ import main as cli_main

REPO = Path(__file__).resolve().parents[1]
PROGRESS = ["near_object", "obj_to_target"]
IMG = 16  # small images keep the tests fast; the layout is the same as 96x96
SPEC = {
    "observation.state": {"shape": [4], "dtype": "float32", "names": ["x", "y", "z", "gripper"], "unit": "m"},
    "observation.environment_state": {"shape": [7], "dtype": "float32"},
    "observation.images.corner": {"shape": [IMG, IMG, 3], "dtype": "uint8"},
    "action": {"shape": [4], "dtype": "float32", "names": ["dx", "dy", "dz", "gripper"]},
    "control_hz": 80.0,
}


def make_step(writer: int, ep: int, t: int):
    """Deterministic step content for (writer, episode, step)."""
    rng = np.random.default_rng([writer, ep, t])
    obs = {
        "observation.state": rng.normal(size=4).astype(np.float32),
        "observation.environment_state": rng.normal(size=7).astype(np.float32),
        "observation.images.corner": rng.integers(0, 256, (IMG, IMG, 3), dtype=np.uint8),
    }
    return obs, rng.uniform(-1, 1, 4).astype(np.float32), float(rng.normal()), {k: float(rng.uniform()) for k in PROGRESS}


def ep_len(writer: int, ep: int) -> int:
    return 5 + (7 * writer + 3 * ep) % 11


def write_episode(w, writer: int, ep: int, task: str = "push-v3", success: bool = True, is_demo: bool = False):
    w.begin_episode(unit_id=writer, embodiment="sawyer", task=task, policy_version=ep % 3, seed=ep, is_demo=is_demo)
    for t in range(ep_len(writer, ep)):
        w.add_step(*make_step(writer, ep, t))
    return w.commit(success=success)


def expected_episode(writer: int, ep: int) -> dict[str, np.ndarray]:
    steps = [make_step(writer, ep, t) for t in range(ep_len(writer, ep))]
    out = {k: np.stack([s[0][k] for s in steps]) for k in steps[0][0]}
    out["action"] = np.stack([s[1] for s in steps])
    out["reward"] = np.array([s[2] for s in steps], dtype=np.float32)
    for k in PROGRESS:
        out[f"progress.{k}"] = np.array([s[3][k] for s in steps], dtype=np.float32)
    return out


def assert_episode_equal(got: dict, want: dict):
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def new_store(url, **kw) -> ExperienceStore:
    return ExperienceStore.create_or_open(str(url), SPEC, progress_keys=PROGRESS, chunk_bytes=4096, **kw)


def run_child(code: str, *args, wait=True):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code), *map(str, args)]
    if wait:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


SHAPES = {"observation.state": (4,), "observation.environment_state": (7,), "action": (4,), "reward": (),
          "progress.near_object": (), "progress.obj_to_target": ()}

CHILD_PRELUDE = f"""
import sys
sys.path.insert(0, {str(REPO / 'tests')!r})
from test_store import new_store, write_episode, make_step, ep_len
"""


# ------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_round_trip_bit_for_bit(tmp_path, kind):
    url = tmp_path / "store" if kind == "local" else f"memory://rt-{os.getpid()}-{time.time_ns()}"
    store = new_store(url)
    w = store.writer("unit-0001")
    ids = [write_episode(w, 1, e, task=["reach-v3", "push-v3"][e % 2], success=e % 3 != 0, is_demo=e == 0)
           for e in range(6)]
    w.close()
    reader = ExperienceStore.open(str(url))
    assert [e.episode_id for e in reader.episodes()] == ids == [f"unit-0001-{i:06d}" for i in range(6)]
    for e, ep_id in enumerate(ids):
        assert_episode_equal(reader.load_episode(ep_id), expected_episode(1, e))
        meta = reader.episode(ep_id)
        assert (meta.length, meta.unit_id, meta.seed, meta.failure_onset) == (ep_len(1, e), 1, e, None)
    # queries
    assert [e.episode_id for e in reader.episodes(task="reach-v3")] == ids[0::2]
    assert {e.episode_id for e in reader.episodes(success=False)} == {ids[0], ids[3]}
    assert [e.episode_id for e in reader.episodes(is_demo=True)] == [ids[0]]
    assert [e.episode_id for e in reader.episodes(policy_version=[1], task="push-v3")] == [ids[1]]
    assert reader.episodes(unit_id=2) == []
    # partial key load and metadata
    part = reader.load_episode(ids[2], keys=["action"])
    assert list(part) == ["action"]
    assert reader.control_hz == 80.0 and reader.spec["action"]["names"] == ["dx", "dy", "dz", "gripper"]
    assert reader.verify()["ok"]


def test_object_store_commits_carry_their_rows_and_chunks_are_written_once_full():
    """Without an atomic rename (memory:// here, S3 in test_store_s3.py) a commit is one PUT: the low-dimensional
    rows travel in the commit record and a lowdim chunk is written only when full. Across a writer reopened in
    the middle (its partly filled chunk rebuilt from the records), every episode reads back bit for bit, a read
    spanning sealed chunks and record rows equals the episodes laid out with zero padding, and a corrupt record
    is named by verify and by the read."""
    from experience_dict.store import CorruptChunkError

    url = f"memory://inline-{os.getpid()}-{time.time_ns()}"
    store = new_store(url)
    ids = []
    for part in (range(5), range(5, 12)):   # close and reopen: recovery from the commit records
        w = store.writer("unit-0003")
        ids += [write_episode(w, 3, e) for e in part]
        w.close()
    reader = ExperienceStore.open(url)
    for e, ep_id in enumerate(ids):
        assert_episode_equal(reader.load_episode(ep_id), expected_episode(3, e))
    eps = reader.episodes()
    end = max(x.start + x.length for x in eps)
    cr = reader.array("unit-0003", "action").chunks[0]
    chunk_objs = [p for p in reader.fs.find(reader._p("shards", "unit-0003", LOWDIM)) if p.rsplit("/", 1)[-1].startswith("c.")]
    assert end > 2 * cr and len(chunk_objs) == end // cr   # only full chunks were written; the rest is in records
    rec = json.loads(reader.fs.cat_file(reader._p("commits", "unit-0003", f"{ids[-1]}.json")))
    assert set(rec["inline"]) == {LOWDIM}
    # one read across sealed chunks and record rows: the episodes at their rows, zeros between them
    want = np.zeros((end, 4), np.float32)
    for x, e in zip(eps, range(len(ids))):
        want[x.start:x.start + x.length] = expected_episode(3, e)["action"]
    np.testing.assert_array_equal(reader.read("unit-0003", "action", 0, end), want)
    np.testing.assert_array_equal(reader.read("unit-0003", "action", cr - 3, end), want[cr - 3:])
    assert reader.verify()["ok"]
    # a corrupt record: named by verify and by the read
    path = reader._p("commits", "unit-0003", f"{ids[-1]}.json")
    rec["inline"][LOWDIM]["data"] = rec["inline"][LOWDIM]["data"][:-8] + "AAAAAAA="
    reader.fs.pipe_file(path, json.dumps(rec).encode())
    named = ExperienceStore.open(url)                     # the record's own CRC-32 names it on open; it is left out
    assert ids[-1] not in [e.episode_id for e in named.episodes()] and len(named.episodes()) == len(ids) - 1
    assert "CRC-32" in named.unreadable_records[path] and named.verify()["unreadable_records"] == [path]
    rec.pop("crc32")                                      # as an earlier writer left it: the rows' CRC names it
    reader.fs.pipe_file(path, json.dumps(rec).encode())
    bad = ExperienceStore.open(url)
    report = bad.verify()
    assert not report["ok"] and report["corrupt_episodes"] == [ids[-1]]
    with pytest.raises(CorruptChunkError, match=ids[-1]):
        bad.load_episode(ids[-1])
    assert_episode_equal(bad.load_episode(ids[0]), expected_episode(3, 0))


def test_stats_match_numpy(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ep_len", lambda w, e: 120 + 10 * e)  # realistic lengths
    store = new_store(tmp_path / "s")
    w = store.writer("u0")
    for e in range(8):
        write_episode(w, 0, e)
    eps = [expected_episode(0, e) for e in range(8)]
    st = ExperienceStore.open(str(tmp_path / "s")).stats()
    for key in ["observation.state", "action", "reward"]:
        allv = np.concatenate([x[key] for x in eps]).reshape(sum(len(x["action"]) for x in eps), -1).astype(np.float64)
        np.testing.assert_allclose(st[key]["mean"], allv.mean(0), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(st[key]["std"], allv.std(0), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(st[key]["min"], allv.min(0), rtol=1e-6)
        np.testing.assert_allclose(st[key]["max"], allv.max(0), rtol=1e-6)
        for name, p in (("q01", 0.01), ("q99", 0.99)):  # rank error of the merged sketch within 1 %
            rank = (allv <= np.array(st[key][name])).mean(0)
            assert np.all(np.abs(rank - p) <= 0.01), (key, name, rank)
    k = IMAGE_STRIDE  # image statistics are over every k-th pixel row and column
    img = np.concatenate([x["observation.images.corner"][:, ::k, ::k] for x in eps]).reshape(-1, 3).astype(np.float64)
    np.testing.assert_allclose(st["observation.images.corner"]["mean"], img.mean(0), rtol=1e-9)
    np.testing.assert_allclose(st["observation.images.corner"]["std"], img.std(0), rtol=1e-9)
    np.testing.assert_array_equal(st["observation.images.corner"]["max"], img.max(0))
    for name, p in (("q01", 0.01), ("q99", 0.99)):
        rank = (img <= np.array(st["observation.images.corner"][name])).mean(0)
        assert np.all(np.abs(rank - p) <= 0.01), (name, rank)


# ------------------------------------------------------------------------------------------ concurrency


def test_two_writer_processes_commit_concurrently(tmp_path):
    url = tmp_path / "store"
    new_store(url)  # create first; the children create_or_open the existing store
    code = """
    url, wid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    w = new_store(url).writer(f"unit-{wid}")
    for e in range(n):
        write_episode(w, wid, e)
    print("done")
    """
    procs = [run_child(code, url, wid, 12, wait=False) for wid in (1, 2)]
    reader = ExperienceStore.open(str(url))
    seen = [len(reader)]
    while any(p.poll() is None for p in procs):  # a reader refreshing while both writers append
        reader.refresh()
        seen.append(len(reader))
        for ep in reader.episodes()[-2:]:
            wid, e = int(ep.shard.split("-")[1]), int(ep.episode_id.rsplit("-", 1)[1])
            assert_episode_equal(reader.load_episode(ep.episode_id), expected_episode(wid, e))
        time.sleep(0.05)
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err
    reader.refresh()
    assert seen == sorted(seen)  # snapshots only grow
    assert len(reader) == 24
    for wid in (1, 2):
        eps = reader.episodes(unit_id=wid)
        assert [e.episode_id for e in eps] == [f"unit-{wid}-{i:06d}" for i in range(12)]
        for e, meta in enumerate(eps):
            assert_episode_equal(reader.load_episode(meta.episode_id), expected_episode(wid, e))
    assert reader.verify()["ok"]


def test_writer_id_is_exclusive(tmp_path):
    store = new_store(tmp_path / "s")
    w = store.writer("unit-7")
    with pytest.raises(WriterBusyError, match=rf"unit-7.*pid {os.getpid()} on "):   # names who holds it
        new_store(tmp_path / "s").writer("unit-7")
    w.close()
    new_store(tmp_path / "s").writer("unit-7").close()  # free again


# ------------------------------------------------------------------------------------------ crashes


@pytest.mark.parametrize("where", ["mid_episode", "mid_commit"])
def test_sigkill_leaves_committed_episodes_intact(tmp_path, where):
    url = tmp_path / "store"
    code = """
    import os, signal
    url, where = sys.argv[1], sys.argv[2]
    w = new_store(url).writer("unit-3")
    for e in range(4):
        write_episode(w, 3, e)
    if where == "mid_commit":
        # die after the rows of episode 4 are appended to every array, before its commit record exists
        w._write_record = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        write_episode(w, 3, 4)
    else:
        w.begin_episode(unit_id=3, embodiment="sawyer", task="push-v3", policy_version=0, seed=4)
        for t in range(5):
            w.add_step(*make_step(3, 4, t))
        print("ready", flush=True)
        import time; time.sleep(60)
    """
    p = run_child(code, url, where, wait=False)
    if where == "mid_episode":
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    reader = ExperienceStore.open(str(url))
    assert [e.episode_id for e in reader.episodes()] == [f"unit-3-{i:06d}" for i in range(4)]
    assert reader.verify()["ok"]
    committed = 0
    for e, meta in enumerate(reader.episodes()):  # episodes start on 5-row image chunks (padding between)
        committed = -(-committed // 5) * 5
        assert meta.start == committed
        committed += ep_len(3, e)
    image_dir = url / "shards/unit-3/observation.images.corner"

    def chunk_files():  # indices of the image chunk files on disk
        return sorted(int(p.name.split(".")[1]) for p in image_dir.glob("c.*") if not p.name.endswith(".partial"))

    first_free = -(-committed // 5)  # first image chunk without committed rows
    if where == "mid_commit":  # the uncommitted rows really were written before the kill
        assert reader.array("unit-3", "action", reopen=True).shape[0] >= committed + ep_len(3, 4)
        assert chunk_files()[-1] >= first_free
    # reopening the writer recovers the shard and keeps appending after the committed rows
    w = new_store(url).writer("unit-3")
    assert w.committed_rows == committed
    # chunks past the commits are deleted (the capacity, rows never read, stays)
    assert reader.array("unit-3", "observation.images.corner", reopen=True).shape[0] >= committed
    assert chunk_files() == list(range(first_free)) and not list(url.rglob("*.partial"))
    assert write_episode(w, 3, 4) == "unit-3-000004"
    reader.refresh()
    for e in range(5):
        assert_episode_equal(reader.load_episode(f"unit-3-{e:06d}"), expected_episode(3, e))
    assert reader.verify()["ok"]


@pytest.mark.slow
def test_sigkill_at_random_times_during_commits(tmp_path):
    """Kill a writer at arbitrary points of a loop of commits (mid-episode, mid-append, mid-record)."""
    url = tmp_path / "store"
    code = """
    url = sys.argv[1]
    w = new_store(url).writer("unit-5")
    e = w._counter
    while True:
        write_episode(w, 5, e); e += 1
        print(e, flush=True)
    """
    rng = np.random.default_rng(0)
    for trial in range(4):
        p = run_child(code, url, wait=False)
        p.stdout.readline()  # at least one commit of this run happened
        time.sleep(float(rng.uniform(0.0, 0.3)))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        reader = ExperienceStore.open(str(url))
        eps = reader.episodes()
        assert [e.episode_id for e in eps] == [f"unit-5-{i:06d}" for i in range(len(eps))]
        assert reader.verify()["ok"], reader.verify()["problems"]
        for meta in eps[-3:]:
            assert_episode_equal(reader.load_episode(meta.episode_id),
                                 expected_episode(5, int(meta.episode_id.rsplit("-", 1)[1])))


@pytest.mark.parametrize("steps", [1, 23])
def test_abort_discards_open_episode(tmp_path, steps):
    store = new_store(tmp_path / "s")
    w = store.writer("u0")
    write_episode(w, 0, 0)
    w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=1)
    for t in range(steps):  # 23 steps fill (and write) several 5-row image chunks before the abort
        w.add_step(*make_step(0, 99, t))
    w.abort()
    assert write_episode(w, 0, 1) == "u0-000001"
    r = ExperienceStore.open(str(tmp_path / "s"))
    assert [e.episode_id for e in r.episodes()] == ["u0-000000", "u0-000001"] and r.verify()["ok"]
    for e in range(2):
        assert_episode_equal(r.load_episode(f"u0-{e:06d}"), expected_episode(0, e))


def test_failed_chunk_write_keeps_episode_open_and_commit_can_be_retried(tmp_path):
    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    write_episode(w, 0, 0)
    real, failed = w._write_chunk, []

    def write_chunk(col, path, block, atomic, rows=None):  # the first image chunk write of episode 1 fails
        if "observation.images" in path and not failed:
            failed.append(path)
            raise OSError(28, "No space left on device (test)")
        return real(col, path, block, atomic, rows)

    w._write_chunk = write_chunk
    w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=1, seed=1)
    for t in range(ep_len(0, 1)):
        w.add_step(*make_step(0, 1, t))
    with pytest.raises(StoreWriteError, match=r"store .*'u0': writing episode u0-000001 .*no space left .*"
                       r"Nothing committed is lost") as err:
        w.commit(success=True)
    assert isinstance(err.value, OSError) and err.value.errno == 28   # still an OSError with its errno
    assert failed and w.open_steps == ep_len(0, 1)  # nothing visible, the episode still open
    reader = ExperienceStore.open(str(url))
    assert [e.episode_id for e in reader.episodes()] == ["u0-000000"]
    assert w.commit(success=True) == "u0-000001"  # every chunk of the episode is written again
    assert write_episode(w, 0, 2) == "u0-000002"
    assert reader.refresh() == 2 and reader.verify()["ok"]
    for e in range(3):
        assert_episode_equal(reader.load_episode(f"u0-{e:06d}"), expected_episode(0, e))


def test_long_episodes_grow_the_step_buffers(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ep_len", lambda w, e: [7, 700, 3, 260][e])
    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    ids = [write_episode(w, 0, e) for e in range(4)]
    reader = ExperienceStore.open(str(url))
    # each episode starts on a chunk boundary of the image array (16x16x3 uint8 in 4096 bytes: 5 rows)
    assert reader.array("u0", "observation.images.corner").chunks[0] == 5
    assert [reader.episode(i).start for i in ids] == [0, 10, 710, 715] and reader.verify()["ok"]
    for e, ep_id in enumerate(ids):
        assert_episode_equal(reader.load_episode(ep_id), expected_episode(0, e))


# ------------------------------------------------------------------------------------------ readers


def test_reader_sees_new_commit_after_refresh(tmp_path):
    store = new_store(tmp_path / "s")
    w = store.writer("u0")
    write_episode(w, 0, 0)
    reader = ExperienceStore.open(str(tmp_path / "s"))
    reader.load_episode("u0-000000")  # opens (and caches) array handles with the old shape
    write_episode(w, 0, 1)
    w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=2)
    w.add_step(*make_step(0, 2, 0))  # open, uncommitted: never visible
    assert len(reader) == 1
    assert reader.refresh() == 1
    assert [e.episode_id for e in reader.episodes()] == ["u0-000000", "u0-000001"]
    assert_episode_equal(reader.load_episode("u0-000001"), expected_episode(0, 1))


def test_failure_onset_annotation(tmp_path):
    store = new_store(tmp_path / "s")
    write_episode(store.writer("u0"), 0, 0, success=False)
    learner = ExperienceStore.open(str(tmp_path / "s"))
    learner.set_failure_onset("u0-000000", 3)
    other = ExperienceStore.open(str(tmp_path / "s"))
    assert other.episode("u0-000000").failure_onset == 3
    learner.set_failure_onset("u0-000000", 2)
    other.refresh()
    assert other.episode("u0-000000").failure_onset == 2
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        learner.set_failure_onset("u0-000000", 99)
    with pytest.raises(KeyError, match="nope"):
        learner.set_failure_onset("nope", 1)


# ------------------------------------------------------------------------------------------ corruption


def test_flipped_byte_is_reported_by_verify(tmp_path, capsys):
    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    ids = [write_episode(w, 0, e) for e in range(4)]
    reader = ExperienceStore.open(str(url))
    assert reader.verify()["ok"]
    arr = reader.array("u0", "observation.images.corner")
    target = reader.episode(ids[2])
    chunk = target.start // arr.chunks[0]
    path = url / "shards/u0/observation.images.corner" / arr.metadata.encode_chunk_key((chunk, 0, 0, 0))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    report = ExperienceStore.open(str(url)).verify()
    assert not report["ok"]
    (prob,) = report["problems"]
    assert prob["key"] == "observation.images.corner" and prob["chunk"] == chunk
    assert "checksum" in prob["error"].lower()
    assert ids[2] in report["corrupt_episodes"]
    with pytest.raises(ValueError, match="checksum"):
        ExperienceStore.open(str(url)).load_episode(ids[2])
    assert cli_main(["verify", str(url)]) == 1
    assert ids[2] in json.loads(capsys.readouterr().out)["corrupt_episodes"]


def test_missing_chunk_is_reported(tmp_path):
    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    write_episode(w, 0, 0)
    (url / "shards/u0" / LOWDIM / "c.0.0").unlink()  # action, state, reward, progress live in lowdim
    report = ExperienceStore.open(str(url)).verify()
    assert not report["ok"] and report["corrupt_episodes"] == ["u0-000000"]
    assert "missing" in report["problems"][0]["error"] and report["problems"][0]["key"] == LOWDIM


def test_missing_chunk_is_named_by_every_read_path(tmp_path):
    """Zarr reads a missing chunk file as zeros; every read of committed rows names it like a corrupt chunk."""
    from experience_dict.sampler import WindowDataset
    from experience_dict.store import CorruptChunkError

    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    ids = [write_episode(w, 0, e) for e in range(12)]
    w.close()
    reader = ExperienceStore.open(str(url))
    cr = int(reader.array("u0", "action").chunks[0])
    hit = [e.episode_id for e in reader.episodes() if e.start < cr]   # episodes with rows in chunk 0
    assert hit and len(hit) < len(ids)
    (url / "shards/u0" / LOWDIM / "c.0.0").unlink()
    reader = ExperienceStore.open(str(url))
    with pytest.raises(CorruptChunkError, match=r"shard 'u0', array 'lowdim': chunk 0 .*c\.0\.0 is missing"):
        reader.load_episode(hit[0])
    assert reader.load_episode(ids[-1])["action"].shape[0] == ep_len(0, 11)   # other chunks still read
    assert sorted(reader.corrupt_episodes()) == sorted(hit)
    left = reader.readable(reader.episodes(), on_corrupt="skip")
    assert {e.episode_id for e in left} == set(ids) - set(hit)
    with pytest.raises(CorruptChunkError, match="is missing"):   # the training sampler
        WindowDataset(reader, windows={"action": ("action", [0, 1])})[0]
    ds = WindowDataset(reader, episodes=left, windows={"action": ("action", [0, 1])})
    np.testing.assert_array_equal(ds[0]["action"][0].numpy(), expected_episode(0, ids.index(left[0].episode_id))["action"][0])


def test_unparseable_array_metadata_is_named(tmp_path):
    """A truncated zarr.json of a shard's array: a named store error, not a bare JSONDecodeError."""
    from experience_dict.store import CorruptChunkError

    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    ids = [write_episode(w, 0, e) for e in range(2)]
    w.close()
    meta = url / "shards/u0" / LOWDIM / "zarr.json"
    meta.write_text(meta.read_text()[:40])
    reader = ExperienceStore.open(str(url))
    with pytest.raises(CorruptChunkError, match=r"shard 'u0', array 'lowdim': its metadata .*zarr.json.*JSONDecodeError"):
        reader.load_episode(ids[0])
    assert sorted(reader.corrupt_episodes()) == sorted(ids)
    assert reader.readable(reader.episodes(), on_corrupt="skip") == []
    assert not reader.verify()["ok"]


def test_cli_info_and_stats(tmp_path, capsys):
    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    write_episode(w, 0, 0, task="reach-v3")
    write_episode(w, 0, 1, task="push-v3", success=False)
    assert cli_main(["info", str(url)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["episodes"] == 2 and info["per_task"] == {"reach-v3": 1, "push-v3": 1}
    assert info["per_success"] == {"True": 1, "False": 1} and info["bytes"] > 0
    assert cli_main(["stats", str(url), "--keys", "action"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert set(stats["action"]) >= {"min", "max", "mean", "std", "q01", "q99"} and len(stats["action"]["mean"]) == 4
    out = subprocess.run([sys.executable, "-m", "experience_dict.store", "verify", str(url)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"]


def test_statistics_skip_nan_and_count_it(tmp_path, capsys):
    """NaN reward / progress ("no signal") is skipped by every statistic and counted; not NaN max/mean/std/q99."""
    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    rewards, near = [], []
    for ep in range(3):
        w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=ep)
        for t in range(ep_len(0, ep)):
            obs, act, rew, prog = make_step(0, ep, t)
            rew = float("nan") if t % 3 == 1 else rew         # some steps without a reward signal
            prog = {**prog, "near_object": float("nan")} if ep == 0 else prog   # episode 0: no progress signal
            rewards.append(rew)
            near.append(prog["near_object"])
            w.add_step(obs, act, rew, prog)
        w.commit(success=True)
    w.close()
    st = ExperienceStore.open(str(url)).stats(["reward", "progress.near_object"])
    for key, vals in (("reward", np.float32(rewards).astype(np.float64)), ("progress.near_object", np.float32(near).astype(np.float64))):
        ok = vals[~np.isnan(vals)]
        got = st[key]
        assert got["nan_count"] == [int(np.isnan(vals).sum())] and got["count"] == len(vals)
        np.testing.assert_allclose(got["mean"], [ok.mean()], rtol=1e-9)
        np.testing.assert_allclose(got["std"], [ok.std()], rtol=1e-9)
        assert got["max"] == [np.float32(ok.max())] and got["min"] == [np.float32(ok.min())]
        assert ok.min() <= got["q01"][0] <= got["q99"][0] <= ok.max()
    assert cli_main(["stats", str(url), "--keys", "reward"]) == 0
    cli = json.loads(capsys.readouterr().out)["reward"]
    assert np.isfinite(cli["max"] + cli["mean"] + cli["std"] + cli["q99"]).all() and cli["nan_count"][0] > 0
    from experience_dict.stats import episode_sketch, merge_sketches

    none = merge_sketches([episode_sketch(np.full((4, 2), np.nan))])   # a dimension with no value at all
    assert none["nan_count"] == [4, 4] and np.isnan(none["mean"] + none["max"] + none["q99"]).all()


# ------------------------------------------------------------------------------------------ bad input


def test_bad_steps_are_rejected_and_committed_data_untouched(tmp_path):
    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    write_episode(w, 0, 0)
    w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=1)
    obs, act, rew, prog = make_step(0, 1, 0)
    with pytest.raises(SpecMismatchError, match=r"'observation.state'.*\(4,\).*float32.*\(3,\)"):
        w.add_step({**obs, "observation.state": obs["observation.state"][:3]}, act, rew, prog)
    with pytest.raises(SpecMismatchError, match=r"'observation.images.corner'.*uint8.*float32"):
        w.add_step({**obs, "observation.images.corner": obs["observation.images.corner"].astype(np.float32)}, act, rew, prog)
    with pytest.raises(SpecMismatchError, match=r"missing key 'observation.environment_state'"):
        w.add_step({k: v for k, v in obs.items() if k != "observation.environment_state"}, act, rew, prog)
    with pytest.raises(SpecMismatchError, match=r"unexpected key 'observation.depth'"):
        w.add_step({**obs, "observation.depth": obs["observation.state"]}, act, rew, prog)
    with pytest.raises(SpecMismatchError, match=r"'action'.*float32.*float64"):
        w.add_step(obs, act.astype(np.float64), rew, prog)
    with pytest.raises(SpecMismatchError, match=r"progress keys.*near_object"):
        w.add_step(obs, act, rew, {"near_object": 0.0})
    with pytest.raises(SpecMismatchError, match=r"'reward'"):
        w.add_step(obs, act, [1.0, 2.0], prog)
    assert w.open_steps == 0  # nothing of the bad steps was buffered
    with pytest.raises(StoreError, match="0 steps"):
        w.commit(success=True)
    w.abort()
    with pytest.raises(StoreError, match="before begin_episode"):
        w.add_step(obs, act, rew, prog)
    r = ExperienceStore.open(str(url))
    assert len(r) == 1 and r.verify()["ok"]
    assert_episode_equal(r.load_episode("u0-000000"), expected_episode(0, 0))


def test_bad_spec_and_schema_version(tmp_path):
    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    write_episode(w, 0, 0)
    w.close()
    bad = {**SPEC, "action": {"shape": [7], "dtype": "float32"}}
    with pytest.raises(SpecMismatchError, match=r"'action'.*shape \[4\].*\[7\]"):
        ExperienceStore.create_or_open(str(url), bad, progress_keys=PROGRESS)
    with pytest.raises(SpecMismatchError, match="'observation.environment_state'"):
        ExperienceStore.create_or_open(str(url), {k: v for k, v in SPEC.items() if k != "observation.environment_state"},
                                       progress_keys=PROGRESS)
    with pytest.raises(SpecMismatchError, match="no 'action'"):
        ExperienceStore.create_or_open(str(tmp_path / "t"), {"observation.state": SPEC["observation.state"]})
    # another schema version
    meta_path = url / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["fleetmind"]["schema_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(SchemaVersionError, match=r"schema_version=99.*reads schema_version in \[1, 2\]"):
        ExperienceStore.open(str(url))
    with pytest.raises(FileNotFoundError, match="no experience store"):
        ExperienceStore.open(str(tmp_path / "nothing"))
    with pytest.raises(StoreError, match="read-only"):
        meta["attributes"]["fleetmind"]["schema_version"] = SCHEMA_VERSION
        meta_path.write_text(json.dumps(meta))
        ExperienceStore.open(str(url)).writer("u1")
    with pytest.raises(ValueError, match="writer_id"):
        new_store(url).writer("bad/id")


# ------------------------------------------------------------------------------------------ schema


def test_lowdim_features_are_one_array_read_as_feature_keys(tmp_path):
    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    ids = [write_episode(w, 0, e) for e in range(3)]
    assert sorted(p.name for p in (url / "shards/u0").iterdir() if p.is_dir()) == ["lowdim", "observation.images.corner"]
    reader = ExperienceStore.open(str(url))
    info = reader.info()
    packed = ["observation.state", "observation.environment_state", "action", "reward", *[f"progress.{k}" for k in PROGRESS]]
    assert info["schema_version"] == SCHEMA_VERSION == 2
    assert info["arrays"][LOWDIM] == {"shape": [4 + 7 + 4 + 1 + len(PROGRESS)], "dtype": "<f4", "keys": packed}
    want = [expected_episode(0, e) for e in range(3)]
    metas = [reader.episode(i) for i in ids]
    assert [m.start for m in metas] == [0, 5, 15]  # episodes start on 5-row image chunks: padding in between
    import zarr

    low = zarr.open_array(str(url / "shards/u0" / LOWDIM), mode="r")
    for key in ["observation.environment_state", "action", "reward", "progress.obj_to_target"]:
        view = reader.array("u0", key)  # behaves like an array of the key's own
        assert view.shape == (low.shape[0], *SHAPES[key]) and view.shape[0] >= metas[-1].start + metas[-1].length
        assert view.chunks[0] == low.chunks[0]
        for meta, x in zip(metas, want):
            rows = view[meta.start:meta.start + meta.length]
            np.testing.assert_array_equal(rows, x[key])
            assert rows.flags.c_contiguous and rows.dtype == np.float32
        assert not view[metas[1].start + metas[1].length:metas[2].start].any()
    # statistics come from one packed sketch of the lowdim array, split per key
    st = reader.stats(["reward", "action", "progress.near_object"])
    allr = np.concatenate([x["reward"] for x in want]).astype(np.float64)
    np.testing.assert_allclose(st["reward"]["mean"], [allr.mean()], rtol=1e-9)
    np.testing.assert_array_equal(st["reward"]["max"], [allr.max()])
    alla = np.concatenate([x["action"] for x in want]).astype(np.float64)
    np.testing.assert_allclose(st["action"]["std"], alla.std(0), rtol=1e-9)
    assert st["progress.near_object"]["count"] == len(allr)
    with pytest.raises(KeyError, match="nope"):
        reader.array("u0", "nope")


def test_image_sketch_equals_episode_sketch():
    from experience_dict.stats import episode_sketch, histogram_sketch
    from experience_dict.store.schema import _image_histogram, _pack_sketch, _unpack_sketch

    rng = np.random.default_rng(0)
    for shape in [(9, 16, 16, 3), (5, 17, 13, 3), (3, 10, 7, 1)]:
        frames = rng.integers(0, 256, shape, dtype=np.uint8)
        frames[:, :, :, 0] //= 3  # a channel that does not reach 255: min/max/quantiles from the counts
        want = episode_sketch(frames, is_image=True)
        assert histogram_sketch(_image_histogram(frames)) == want
        # the writer counts pixels chunk by chunk: the parts' histograms sum to the same sketch
        parts = [_image_histogram(frames[a:b]) for a, b in [(0, 2), (2, 3), (3, shape[0])]]
        assert histogram_sketch(sum(parts)) == want
        sub = frames[:, ::4, ::4].reshape(-1, shape[-1]).astype(np.float64)  # numpy's own figures, subsample
        np.testing.assert_allclose(want["mean"], sub.mean(0), rtol=1e-12)
        assert want["max"] == sub.max(0).tolist() and want["min"] == sub.min(0).tolist()
        got = _unpack_sketch(_pack_sketch(want), "test")  # packed in commit records, exactly
        assert got["n"] == want["n"] and got["q"].shape == (len(want["q"]), shape[-1])
        for f in ("mean", "m2", "min", "max", "q"):
            np.testing.assert_array_equal(got[f], np.asarray(want[f], np.float64))
    with pytest.raises(ValueError, match="at least one pixel"):
        histogram_sketch(np.zeros((256, 3), np.int64))
    with pytest.raises(StoreError, match="malformed statistics sketch in rec"):
        _unpack_sketch({"n": 3, "d": 2, "f64": "AAAA"}, "rec")


def write_schema1_store(url: Path, n_episodes: int) -> list[str]:
    """A store in the schema 1 layout, as the previous writer wrote it: one array per feature key (reward and
    every progress key too), statistics sketches as JSON lists in the commit records."""
    import dataclasses

    import zarr
    from zarr.codecs import BloscCodec, Crc32cCodec

    from experience_dict.stats import episode_sketch
    from experience_dict.store.schema import _parse_spec

    parsed = _parse_spec(SPEC, None, PROGRESS)
    meta = {"schema_version": 1, "created": 0.0, "chunk_bytes": 4096, "max_chunk_rows": 8192, "image_clevel": 1, **parsed}
    zarr.create_group(str(url), attributes={"fleetmind": meta})
    eps = [expected_episode(0, e) for e in range(n_episodes)]
    for key, feat in parsed["features"].items():
        zarr.create_array(str(url), name=f"shards/u0/{key}", data=np.concatenate([x[key] for x in eps]),
                          chunks=(7, *feat["shape"]), compressors=[BloscCodec(cname="zstd", clevel=3), Crc32cCodec()],
                          chunk_key_encoding={"name": "default", "separator": "."})
    (url / "commits/u0").mkdir(parents=True)
    ids, start = [], 0
    for e, x in enumerate(eps):
        meta = EpisodeMeta(episode_id=f"u0-{e:06d}", unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0,
                           seed=e, start_time=0.0, length=len(x["action"]), success=True, failure_onset=None,
                           is_demo=False, shard="u0", start=start)
        sketch = {k: episode_sketch(v, is_image=k.startswith("observation.images")) for k, v in x.items()}
        (url / f"commits/u0/{meta.episode_id}.json").write_text(json.dumps({"episode": dataclasses.asdict(meta),
                                                                            "sketch": sketch}))
        ids.append(meta.episode_id)
        start += meta.length
    return ids


def test_schema1_store_is_read_but_not_appended_to(tmp_path):
    url = tmp_path / "old"
    ids = write_schema1_store(url, 3)
    reader = ExperienceStore.open(str(url))
    assert reader.schema_version == 1 and reader.info()["arrays"]["reward"]["keys"] == ["reward"]
    for e, ep_id in enumerate(ids):
        assert_episode_equal(reader.load_episode(ep_id), expected_episode(0, e))
    st = reader.stats(["reward", "observation.state"])
    allr = np.concatenate([expected_episode(0, e)["reward"] for e in range(3)]).astype(np.float64)
    np.testing.assert_allclose(st["reward"]["mean"], [allr.mean()], rtol=1e-9)
    assert reader.verify()["ok"] and reader.array("u0", "reward").chunks == (7,)
    with pytest.raises(SchemaVersionError, match=r"schema_version=1.*appends only to schema_version=2"):
        new_store(url)
    with pytest.raises(SchemaVersionError, match="schema_version=1"):
        ExperienceStore(str(url), read_only=False).writer("u1")


def test_two_cameras_with_different_chunk_rows(tmp_path):
    """Episodes start on the chunks of the biggest camera (24x24x3: 2 rows per 4096-byte chunk); the other
    camera's chunks (5 rows) then straddle episodes: its committed rows are carried over and rewritten."""
    spec = {**SPEC, "observation.images.wrist": {"shape": [24, 24, 3], "dtype": "uint8"}}
    url = tmp_path / "s"

    def step(ep, t):
        obs, act, rew, prog = make_step(0, ep, t)
        wrist = np.random.default_rng([ep, t, 7]).integers(0, 256, (24, 24, 3), dtype=np.uint8)
        return {**obs, "observation.images.wrist": wrist}, act, rew, prog

    lengths = [7, 4, 11, 1, 6]
    store = ExperienceStore.create_or_open(str(url), spec, progress_keys=PROGRESS, chunk_bytes=4096)
    w = store.writer("u0")
    for e, n in enumerate(lengths[:3]):
        w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=e)
        for t in range(n):
            w.add_step(*step(e, t))
        w.commit(success=True)
    w.close()
    w = ExperienceStore.create_or_open(str(url), spec, progress_keys=PROGRESS).writer("u0")  # reads the tails back
    for e, n in list(enumerate(lengths))[3:]:
        w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=e)
        for t in range(n):
            w.add_step(*step(e, t))
        w.commit(success=True)
    reader = ExperienceStore.open(str(url))
    assert [reader.array("u0", k).chunks[0] for k in ("observation.images.wrist", "observation.images.corner")] == [2, 5]
    assert [e.start for e in reader.episodes()] == [0, 8, 12, 24, 26] and reader.verify()["ok"]
    wrist = []
    for e, meta in enumerate(reader.episodes()):
        got = reader.load_episode(meta.episode_id)
        want = [step(e, t) for t in range(lengths[e])]
        np.testing.assert_array_equal(got["observation.images.wrist"], np.stack([s[0]["observation.images.wrist"] for s in want]))
        np.testing.assert_array_equal(got["observation.images.corner"], np.stack([s[0]["observation.images.corner"] for s in want]))
        np.testing.assert_array_equal(got["action"], np.stack([s[1] for s in want]))
        wrist.append(got["observation.images.wrist"])
    px = np.concatenate(wrist)[:, ::IMAGE_STRIDE, ::IMAGE_STRIDE].reshape(-1, 3).astype(np.float64)
    st = reader.stats(["observation.images.wrist"])["observation.images.wrist"]
    np.testing.assert_allclose(st["mean"], px.mean(0), rtol=1e-9)
    assert st["count"] == len(px)


@pytest.mark.parametrize("progress_keys", [[], ["obj_to_target"]])
def test_zero_or_one_progress_key(tmp_path, progress_keys):
    store = ExperienceStore.create_or_open(str(tmp_path / "s"), SPEC, progress_keys=progress_keys, chunk_bytes=4096)
    w = store.writer("u0")
    w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=0)
    steps = [make_step(0, 0, t) for t in range(9)]
    for obs, act, rew, prog in steps:
        w.add_step(obs, act, rew, {k: prog[k] for k in progress_keys})
    w.commit(success=True)
    got = ExperienceStore.open(str(tmp_path / "s")).load_episode("u0-000000")
    assert sorted(got) == sorted([*SPEC.keys() - {"control_hz"}, "reward", *[f"progress.{k}" for k in progress_keys]])
    np.testing.assert_array_equal(got["reward"], np.array([s[2] for s in steps], np.float32))
    for k in progress_keys:
        np.testing.assert_array_equal(got[f"progress.{k}"], np.array([s[3][k] for s in steps], np.float32))


@pytest.mark.parametrize("where", ["observation.state", "observation.environment_state", "action", "reward"])
def test_non_finite_steps_are_refused_or_quarantined(tmp_path, where):
    """The writer refuses NaN/inf observation or action values (and an infinite reward), naming the key, with
    nothing buffered; ``non_finite="quarantine"`` commits the episode as a quarantined failure that readers
    and statistics leave out; ``verify`` reports non-finite rows of a non-quarantined episode."""
    url = tmp_path / "s"
    store = new_store(url)
    w = store.writer("u0")
    write_episode(w, 0, 0)

    def bad_step(t, value):
        obs, act, rew, prog = make_step(0, 1, t)
        if where == "action":
            act = act.copy()
            act[2] = value
        elif where == "reward":
            rew = value
        else:
            obs = {**obs, where: obs[where].copy()}
            obs[where][1] = value
        return obs, act, rew, prog

    w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=1)
    w.add_step(*make_step(0, 1, 0))
    for value in ([np.inf] if where == "reward" else [np.nan, np.inf, -np.inf]):
        with pytest.raises(NonFiniteError, match=rf"step 1 .*seed 1.*\['{where}'\]"):
            w.add_step(*bad_step(1, value))
    assert w.open_steps == 1                                          # the bad step was not buffered
    if where == "reward":                                              # NaN reward = "no signal" (real arms)
        obs, act, _, prog = make_step(0, 1, 1)
        w.add_step(obs, act, float("nan"), prog)
    assert w.commit(success=True, termination="truncated") == "u0-000001"
    w.close()
    q = store.writer("u0", non_finite="quarantine")
    q.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=2)
    q.add_step(*make_step(0, 2, 0))
    q.add_step(*bad_step(1, np.nan if where != "reward" else np.inf))
    q.add_step(*make_step(0, 2, 2))
    qid = q.commit(success=True)
    q.close()
    r = ExperienceStore.open(str(url))
    meta = r.episode(qid)
    assert meta.quarantined and not meta.success and meta.termination == "non_finite"
    assert r.episode("u0-000001").termination == "truncated" and r.episode("u0-000000").termination is None
    assert qid not in [e.episode_id for e in r.episodes()] and [e.episode_id for e in r.episodes(quarantined=True)] == [qid]
    st = r.stats(["action", "observation.state", "observation.environment_state"])
    assert all(np.isfinite(st[k][m]).all() for k in st for m in ("min", "max", "mean", "std"))
    v = r.verify()
    assert v["ok"] and v["quarantined_episodes"] == [qid] and v["non_finite_episodes"] == []
    if where != "reward":
        assert [p["episodes"] for p in v["non_finite"]] == [[qid]] and v["non_finite"][0]["key"] == where
        # the same record without its quarantine flag (as an older writer would have left it): verify fails
        rec_path = next((url / "commits" / "u0").glob("*2*.json"))
        rec = json.loads(rec_path.read_text())
        assert rec["episode"]["episode_id"] == qid
        rec["episode"]["quarantined"] = False
        rec.pop("crc32")                          # an older writer's record carries no CRC-32
        rec_path.write_text(json.dumps(rec))
        v = ExperienceStore.open(str(url)).verify()
        assert not v["ok"] and v["non_finite_episodes"] == [qid]
        rec["episode"]["quarantined"] = True      # edited with its CRC-32 in place: the record is named on open
        rec_path.write_text(json.dumps({**rec, "crc32": 1}))
        named = ExperienceStore.open(str(url))
        assert [p for p in named.unreadable_records if p.endswith("u0-000002.json")]
        assert "CRC-32" in next(iter(named.unreadable_records.values()))
    with pytest.raises(ValueError, match="non_finite"):
        store.writer("u1", non_finite="drop")


def test_one_unreadable_commit_record_hides_only_its_own_episode(tmp_path, caplog):
    """Issue 52, item 18: a flipped byte in one commit record is named (once in the log, by verify and the CLI) and its
    episode left out; every other episode stays readable, in reads, verify and the skip-on-corrupt path; the writer
    refuses to resume past a record it cannot read (where its rows end is unknown) instead of losing them."""
    import logging
    import subprocess

    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    ids = [write_episode(w, 0, e) for e in range(12)]
    w.close()
    path = url / "commits" / "u0" / f"{ids[4]}.json"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x5A                          # one flipped byte in the middle of the record
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="fleetmind.store"):
        r = ExperienceStore.open(str(url))
        r.refresh()                                    # named once, not at every refresh
    assert sum(ids[4] in m for m in caplog.messages) == 1
    left = [e.episode_id for e in r.episodes()]
    assert left == [i for i in ids if i != ids[4]]
    for e in (0, 5, 11):
        assert_episode_equal(r.load_episode(ids[e]), expected_episode(0, e))
    assert [e.episode_id for e in r.readable(r.episodes(), on_corrupt="skip")] == left
    rep = r.verify()
    assert not rep["ok"] and rep["unreadable_records"] == [r._p("commits", "u0", f"{ids[4]}.json")]
    assert rep["corrupt_episodes"] == [] and not any("missing" in p["error"] for p in rep["problems"])
    cli = subprocess.run([sys.executable, "-m", "experience_dict.store", "verify", str(url)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert cli.returncode == 1 and ids[4] in cli.stdout
    path.write_text("{")                               # not even JSON: the writer will not append past it
    with pytest.raises(StoreError, match=rf"cannot resume.*{ids[4]}"):
        new_store(url).writer("u0")
    assert len(ExperienceStore.open(str(url)).episodes()) == 11


def test_truncated_lowdim_chunk_is_named_by_readers_and_skipped_on_request(tmp_path):
    """A truncated lowdim chunk: load_episode and the training sampler name store, shard, array, chunk and
    episodes; ``readable(on_corrupt="skip")`` leaves exactly the affected episodes out."""
    from experience_dict.sampler import WindowDataset
    from experience_dict.store import CorruptChunkError

    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    ids = [write_episode(w, 0, e) for e in range(8)]
    w.close()
    reader = ExperienceStore.open(str(url))
    arr = reader._array("u0", LOWDIM)
    cr = arr.chunks[0]
    target = reader.episode(ids[5])
    c = target.start // cr
    path = url / "shards/u0" / LOWDIM / arr.metadata.encode_chunk_key((c, 0))
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])          # truncated
    hit = [e.episode_id for e in reader.episodes() if e.start < (c + 1) * cr and e.start + e.length > c * cr]
    assert ids[5] in hit and len(hit) < len(ids)
    r = ExperienceStore.open(str(url))
    with pytest.raises(CorruptChunkError, match=rf"shard 'u0', array '{LOWDIM}': chunk {c} .*{ids[5]}") as ei:
        r.load_episode(ids[5], ["action"])
    assert str(url) in str(ei.value) and "verify" in str(ei.value)
    ds = WindowDataset(r, r.episodes(), windows={"action": ("action", [0, 1])})
    with pytest.raises(CorruptChunkError, match=rf"chunk {c} "):
        ds.fetch([0, 1])
    assert r.readable(r.episodes()) == r.episodes()                       # raise: nothing read up front
    ok = r.readable(r.episodes(), on_corrupt="skip")
    assert sorted(e.episode_id for e in ok) == sorted(set(ids) - set(hit))
    assert sorted(r.corrupt_episodes()) == sorted(hit)
    ds = WindowDataset(r, ok, windows={"action": ("action", [0, 1])})
    assert ds.fetch(list(range(len(ds))))["action"].shape == (len(ds), 2, 4)
    with pytest.raises(ValueError, match="on_corrupt"):
        r.readable(r.episodes(), on_corrupt="ignore")


def test_the_zarr_adapter_still_fits_the_installed_zarr():
    """The store's only use of zarr's private APIs (experience_dict/store/zarr_compat.py): a chunk encoded through
    the synchronous codec chain is byte for byte what zarr writes; a zarr release that moves them fails here,
    naming what moved, not deep inside a commit."""
    from experience_dict.store import zarr_compat

    zarr_compat.check()


def test_rows_check_accepts_earlier_writers_nan_sketches(tmp_path):
    """Sketches written before the statistics skipped NaN hold NaN max / mean for a column with a NaN reward;
    reading such an episode still works (a NaN in the record says nothing), and a real mismatch is still named."""
    from experience_dict.store import CorruptChunkError

    url = tmp_path / "s"
    w = new_store(url).writer("u0")
    w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=0, seed=0)
    for t in range(6):
        obs, act, rew, prog = make_step(0, 0, t)
        w.add_step(obs, act, float("nan") if t == 2 else rew, prog)
    eid = w.commit(success=True)
    w.close()
    r = ExperienceStore.open(str(url))
    ep = r.episode(eid)
    sk = r._sketches[eid]["reward"]
    old = {**sk, "max": np.array([np.nan]), "mean": np.array([np.nan])}   # as the earlier sketch said
    old.pop("nan", None)
    r._sketches[eid]["reward"] = old
    rows = r.load_episode(eid)["reward"]
    assert np.isnan(rows[2]) and np.isfinite(np.delete(rows, 2)).all()
    r._sketches[eid]["reward"] = {**old, "min": np.array([123.0])}
    with pytest.raises(CorruptChunkError, match="disagree with the statistics"):
        r.check_rows(ep, "reward", rows)


def test_missing_store_is_named(tmp_path):
    """Opening a URL that holds no store raises StoreNotFoundError (a StoreError, so the scripts print it in one
    line, and a FileNotFoundError, as before) naming the URL."""
    from experience_dict.store import StoreError, StoreNotFoundError

    with pytest.raises(StoreNotFoundError, match="no experience store at") as e:
        ExperienceStore.open(str(tmp_path / "no_store"))
    assert isinstance(e.value, StoreError) and isinstance(e.value, FileNotFoundError)


def test_a_mixed_fleets_episodes_keep_their_control_rates(tmp_path):
    """One store, two robots at different rates (a mixed fleet): an episode recorded at another rate than the
    store's keeps it in its metadata (an episode at the store's rate keeps the record as before), copies carry it,
    and a bad rate is refused without leaving an episode open."""
    from experience_dict.store import copy_episodes

    st = new_store(tmp_path / "s")
    w = st.writer("unit-0000")
    write_episode(w, 0, 0)
    w.begin_episode(unit_id=0, embodiment="so100", task="so100-reach", policy_version=1, seed=1, control_hz=30.0)
    for t in range(6):
        w.add_step(*make_step(0, 1, t))
    slow = w.commit(success=False)
    w.begin_episode(unit_id=0, embodiment="sawyer", task="push-v3", policy_version=1, seed=2, control_hz=80.0)
    w.add_step(*make_step(0, 2, 0))
    same = w.commit(success=True)
    for bad in (0.0, -30.0, float("nan")):
        with pytest.raises(ValueError, match="control_hz must be a positive number"):
            w.begin_episode(unit_id=0, embodiment="so100", task="so100-reach", policy_version=1, seed=3,
                            control_hz=bad)
    write_episode(w, 0, 4)   # the refused begin left no episode open
    w.close()
    r = ExperienceStore.open(str(tmp_path / "s"))
    by = {m.episode_id: m for m in r.episodes()}
    assert by[slow].control_hz == 30.0 and r.episode_hz(by[slow]) == 30.0
    assert by[same].control_hz is None and r.episode_hz(by[same]) == 80.0 == r.control_hz
    rec = json.loads(next((tmp_path / "s" / "commits" / "unit-0000").glob(f"{same}.json")).read_text())
    assert "control_hz" not in json.dumps(rec["episode"]), rec["episode"]
    copy_episodes(r, str(tmp_path / "d"), [by[slow], by[same]])
    d = ExperienceStore.open(str(tmp_path / "d"))
    assert sorted(d.episode_hz(m) for m in d.episodes()) == [30.0, 80.0]
