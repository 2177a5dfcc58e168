"""Fault injection on a real store, and the check that every read either returns the committed data or names
the damage (``scripts/fuzz_store.py``, ``tests/test_store_fuzz.py``).

A *case* copies a small store, damages one file in one way, then runs every read path on the copy:
``ExperienceStore.open``, ``load_episode`` of every episode, ``corrupt_episodes``, ``readable(on_corrupt="skip")``,
``verify`` and the training sampler (:class:`experience_dict.sampler.WindowDataset`). Each read's outcome is one of

* ``exact``: the data equals what the undamaged store returned;
* ``named``: it raised a store error (:class:`~experience_dict.store.StoreError`, or ``FileNotFoundError`` "no
  experience store") whose message names the store;
* ``silent_wrong``: it returned data that differs from the committed data (the worst outcome);
* ``unnamed``: it raised anything else (a bare ``JSONDecodeError``, ``KeyError``, ...).

A store passes a case when no read is ``silent_wrong`` or ``unnamed``, and ``verify`` reports a problem (or a
quarantine) whenever some read was not ``exact``. One damage cannot be seen, by design: the newest commit record
of a shard deleted leaves what a writer killed before its commit point leaves (its rows, no record), so that
episode is lost without a trace; such cases are counted as ``undetectable``, apart from the failures.
"""

from __future__ import annotations

import random
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

PROGRESS = ["near_object", "obj_to_target"]
IMG = 16
SPEC = {
    "observation.state": {"shape": [4], "dtype": "float32"},
    "observation.environment_state": {"shape": [7], "dtype": "float32"},
    "observation.images.corner": {"shape": [IMG, IMG, 3], "dtype": "uint8"},
    "action": {"shape": [4], "dtype": "float32"},
    "control_hz": 80.0,
}
WINDOWS = {"observation.state": ("observation.state", [-1, 0]), "action": ("action", [0, 1, 2, 3]),
           "observation.images.corner": ("observation.images.corner", [0])}


def build_store(url: str | Path, writers: int = 2, episodes: int = 6) -> None:
    """A small real store whose content is a pure function of (writer, episode, step)."""
    from experience_dict.store import ExperienceStore

    store = ExperienceStore.create_or_open(str(url), SPEC, progress_keys=PROGRESS, chunk_bytes=4096)
    for w in range(writers):
        wr = store.writer(f"u{w}")
        for e in range(episodes):
            wr.begin_episode(unit_id=w, embodiment="sawyer", task=["reach-v3", "push-v3"][e % 2],
                             policy_version=e % 3, seed=e)
            for t in range(5 + (7 * w + 3 * e) % 11):
                rng = np.random.default_rng([w, e, t])
                obs = {"observation.state": rng.normal(size=4).astype(np.float32),
                       "observation.environment_state": rng.normal(size=7).astype(np.float32),
                       "observation.images.corner": rng.integers(0, 256, (IMG, IMG, 3), dtype=np.uint8)}
                wr.add_step(obs, rng.uniform(-1, 1, 4).astype(np.float32), float(rng.normal()),
                            {k: float(rng.uniform()) for k in PROGRESS})
            wr.commit(success=bool(e % 3))
        wr.close()


FAULTS = ("delete", "truncate", "bitflip", "replace")
TARGETS = ("chunk", "commit", "array_meta")


def store_files(root: str | Path) -> dict[str, list[Path]]:
    """The files of a local store by kind: ``chunk`` (array chunk files), ``commit`` (commit records),
    ``array_meta`` (the shards' arrays' ``zarr.json``)."""
    root = Path(root)
    out: dict[str, list[Path]] = {k: [] for k in TARGETS}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name.startswith(".") or "spare" in p.name or p.name.endswith(".lock"):
            continue
        rel = p.relative_to(root).parts
        if rel[0] == "commits" and p.suffix == ".json":
            out["commit"].append(p)
        elif rel[0] == "shards" and p.name == "zarr.json" and len(rel) == 4:
            out["array_meta"].append(p)
        elif rel[0] == "shards" and p.name.startswith("c") and len(rel) >= 4 and p.name != "zarr.json":
            out["chunk"].append(p)
    return out


def inject(root: str | Path, target: str, fault: str, rng: random.Random) -> str:
    """Damage one file of kind ``target`` of the local store at ``root`` with ``fault``; returns what was done.

    ``replace``: the file's bytes become those of another file of the same kind (a chunk of another place, a
    commit record of another episode: each valid on its own, so checksums inside the file still pass).

    Raises:
        ValueError: an unknown target or fault, or no file of that kind (or no other for ``replace``).
    """
    if target not in TARGETS or fault not in FAULTS:
        raise ValueError(f"inject: target in {TARGETS}, fault in {FAULTS}; given {target!r}, {fault!r}")
    files = store_files(root)[target]
    if not files:
        raise ValueError(f"inject: no {target} file in {root}")
    f = rng.choice(files)
    data = f.read_bytes()
    if fault == "delete":
        f.unlink()
    elif fault == "truncate":
        f.write_bytes(data[:rng.randrange(len(data))] if data else b"")
    elif fault == "bitflip":
        if not data:
            f.write_bytes(b"\x01")
        else:
            i = rng.randrange(len(data))
            f.write_bytes(data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:])
    else:
        others = [o for o in files if o != f and o.read_bytes() != data]
        if not others:
            raise ValueError(f"inject: no other {target} file with other bytes to replace {f} with")
        o = rng.choice(others)
        f.write_bytes(o.read_bytes())
        return f"{fault} {f.relative_to(root)} <- {o.relative_to(root)}"
    return f"{fault} {f.relative_to(root)}"


def _named(err: BaseException, url: str) -> bool:
    from experience_dict.store import StoreError

    msg = str(err)
    if isinstance(err, StoreError):
        return url in msg or "store" in msg
    return isinstance(err, FileNotFoundError) and "no experience store" in msg


def snapshot(url: str, windows: dict) -> dict:
    """What the undamaged store returns: every episode's data, the sampler's items, the episode ids."""
    from experience_dict.sampler import WindowDataset
    from experience_dict.store import ExperienceStore

    st = ExperienceStore.open(url)
    eps = {e.episode_id: st.load_episode(e.episode_id) for e in st.episodes(quarantined=None)}
    ds = WindowDataset(st, windows=windows)
    items = {(int(ds[i]["episode_index"]), int(ds[i]["step"])): _item(ds[i]) for i in range(len(ds))}
    ids = [e.episode_id for e in st.episodes()]
    metas = {e.episode_id: e for e in st.episodes(quarantined=None)}
    return {"episodes": eps, "items": {(ids[k[0]], k[1]): v for k, v in items.items()}, "ids": ids, "metas": metas,
            "stats": st.stats()}


def _item(it: dict) -> dict:
    return {k: v.numpy().copy() for k, v in it.items() if hasattr(v, "numpy")}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def check_reads(url: str, truth: dict, windows: dict) -> dict:
    """Every read path on the (damaged) store at ``url``, against ``truth`` (:func:`snapshot` of it undamaged).

    Returns ``{"reads": {path: {outcome: count}}, "failures": [str], "verify_flagged": bool, "damaged": bool}``;
    ``failures`` lists each ``silent_wrong`` / ``unnamed`` read with its traceback's last line.
    """
    from experience_dict.sampler import WindowDataset
    from experience_dict.store import ExperienceStore

    reads: dict[str, dict[str, int]] = {}
    failures: list[str] = []
    damaged = False

    def record(path: str, fn: Callable[[], object], expect=None) -> object:
        nonlocal damaged
        box = reads.setdefault(path, {})
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - classified
            kind = "named" if _named(e, url) else "unnamed"
            damaged = True
            if kind == "unnamed":
                failures.append(f"{path}: {type(e).__name__}: {str(e)[:300]} | "
                                f"{traceback.format_exc().strip().splitlines()[-3].strip()[:200]}")
            box[kind] = box.get(kind, 0) + 1
            return None
        if expect is not None:
            kind = "exact" if expect(got) else "silent_wrong"
            if kind == "silent_wrong":
                damaged = True
                failures.append(f"{path}: returned data that differs from the committed data")
        else:
            kind = "exact"
        box[kind] = box.get(kind, 0) + 1
        return got

    st = record("open", lambda: ExperienceStore.open(url))
    if st is None:
        return {"reads": reads, "failures": failures, "verify_flagged": True, "damaged": damaged}
    ids = [e.episode_id for e in st.episodes(quarantined=None)]
    changed = [i for i in ids if i in truth["metas"] and st.episode(i) != truth["metas"][i]]
    if changed:   # a commit record that still parses but says something else
        failures.append(f"open: the metadata of episodes {changed} differs from what was committed")
        reads["open"]["silent_wrong"] = reads["open"].get("silent_wrong", 0) + 1
        reads["open"]["exact"] -= 1
        damaged = True
    if sorted(ids) != sorted(truth["episodes"]):   # a commit record lost or changed: that is damage too
        lost = sorted(set(truth["episodes"]) - set(ids))
        extra = sorted(set(ids) - set(truth["episodes"]))
        if extra:
            failures.append(f"open: episodes that were never committed appear: {extra}")
            reads["open"]["silent_wrong"] = reads["open"].get("silent_wrong", 0) + 1
        damaged = damaged or bool(lost)
        newest = {}
        for i in truth["episodes"]:
            shard, n = i.rsplit("-", 1)
            newest[shard] = max(newest.get(shard, -1), int(n))
        lost_last = bool(lost) and not extra and all(int(i.rsplit("-", 1)[1]) == newest[i.rsplit("-", 1)[0]]
                                                     for i in lost)
    else:
        lost_last = False
    for i in ids:
        want = truth["episodes"].get(i)
        record("load_episode", lambda i=i: st.load_episode(i),
               (lambda got, want=want: want is not None and _same(got, want)))
    def sample_all(eps):
        ds = WindowDataset(st, episodes=eps, windows=windows)
        out = []
        for j in range(len(ds)):
            it = ds[j]
            out.append(((eps[int(it["episode_index"])].episode_id, int(it["step"])), _item(it)))
        return out

    def same_items(items) -> bool:
        return all(k in truth["items"] and _same(v, truth["items"][k]) for k, v in items)

    # the normalization statistics, merged from the commit records' sketches: the same whenever every record is
    # there (a lost record changes them rightly: that episode is gone)
    if sorted(ids) == sorted(truth["episodes"]):
        record("stats", lambda: st.stats(),
               lambda got: all(np.allclose(np.asarray(got[k][m], float), np.asarray(v[m], float), rtol=1e-9,
                                           equal_nan=True) for k, v in truth["stats"].items() for m in v))
    # the training sampler on every episode (store.on_corrupt=raise, the default)
    record("sampler", lambda: sample_all(st.episodes()), same_items)
    bad = record("corrupt_episodes", lambda: st.corrupt_episodes()) or {}
    left = record("readable_skip", lambda: st.readable(st.episodes(), on_corrupt="skip")) or []
    if left:   # the sampler on what store.on_corrupt=skip kept
        record("sampler_after_skip", lambda: sample_all(left), same_items)
    rep = record("verify", lambda: st.verify())
    flagged = rep is None or not rep["ok"] or bool(bad) or len(left) < len(ids)
    return {"reads": reads, "failures": failures, "verify_flagged": flagged, "damaged": damaged,
            "lost_last_record_only": lost_last and not failures and all(
                set(v) <= {"exact"} for k, v in reads.items() if k != "open")}


def run_case(base: str | Path, work: str | Path, truth: dict, windows: dict, target: str, fault: str,
             seed: int) -> dict:
    """Copy the store at ``base`` to ``work``, inject one fault, check every read. Returns :func:`check_reads`'s
    dict plus ``"fault"`` (what was done) and ``"ok"`` (no silent wrong read, no unnamed error, and damage seen
    by a read is flagged by verify / corrupt_episodes / readable)."""
    work = Path(work)
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(base, work)
    try:
        what = inject(work, target, fault, random.Random(seed))
    except ValueError as e:
        return {"fault": f"skipped: {e}", "ok": True, "reads": {}, "failures": [], "skipped": True}
    res = check_reads(str(work), truth, windows)
    res["fault"] = what
    unflagged = res["damaged"] and not res["verify_flagged"]
    if unflagged and res.get("lost_last_record_only"):
        # the newest commit record of a shard gone: the same store a writer killed before its commit point
        # leaves (rows written, no record), so nothing can tell it from a crash; the episode is lost, not wrong
        res["undetectable"] = True
    elif unflagged:
        res["failures"].append("a read failed but verify, corrupt_episodes and readable(skip) flagged nothing")
    res["ok"] = not res["failures"]
    return res
