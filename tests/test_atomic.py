"""experience_dict.atomic: a local file replaced atomically (temp file beside it + os.replace)."""

import json
import os
from pathlib import Path

import pytest

from experience_dict.atomic import atomic_write_bytes, atomic_write_text


def test_writes_and_replaces_content_without_leaving_temp_files(tmp_path):
    p = tmp_path / "state.json"
    atomic_write_text(p, json.dumps({"round": 1}))
    assert json.loads(p.read_text()) == {"round": 1}
    atomic_write_bytes(str(p), b"\x00new\xff", fsync=True)   # str path, fsync, overwrite
    assert p.read_bytes() == b"\x00new\xff"
    atomic_write_text(p, "é\n", encoding="utf-8")
    assert p.read_bytes() == "é\n".encode()   # utf-8, no newline translation
    assert os.listdir(tmp_path) == ["state.json"]


def test_failing_write_keeps_old_file_and_removes_temp(tmp_path, monkeypatch):
    p = tmp_path / "job_state.json"
    p.write_text("old")

    class Boom(Exception):
        pass

    real_replace = os.replace
    seen = []

    def replace(src, dst):   # the temp file exists, fully written, when the rename fails
        seen.append(Path(src).read_bytes())
        raise Boom

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Boom):
        atomic_write_bytes(p, b"new")
    monkeypatch.setattr(os, "replace", real_replace)
    assert seen == [b"new"]
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["job_state.json"]

    with pytest.raises(TypeError):   # a failing write(): not bytes
        atomic_write_bytes(p, "not bytes")  # type: ignore[arg-type]
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["job_state.json"]

    with pytest.raises(UnicodeEncodeError):   # nothing written at all
        atomic_write_text(p, "é", encoding="ascii")
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["job_state.json"]


def test_missing_parent_directory_raises_and_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write_bytes(tmp_path / "absent" / "f.json", b"x")
    assert os.listdir(tmp_path) == []


def test_atomic_dir_appears_whole_or_not_at_all(tmp_path):
    """atomic_dir: the directory appears only when its block ends; an error leaves the old one and no temp
    directory; replace=False keeps a directory another process made meanwhile."""
    from experience_dict.atomic import atomic_dir

    out = tmp_path / "sub" / "ckpt"
    with atomic_dir(out) as d:
        (d / "a.json").write_text("1")
        assert not out.exists() and d.parent == out.parent and d.name.startswith(".ckpt.")
    assert (out / "a.json").read_text() == "1"
    with pytest.raises(RuntimeError, match="killed"), atomic_dir(out) as d:
        (d / "a.json").write_text("2")
        raise RuntimeError("killed mid-write")
    assert (out / "a.json").read_text() == "1" and sorted(p.name for p in out.parent.iterdir()) == ["ckpt"]
    with atomic_dir(out) as d:
        (d / "b.json").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == ["b.json"]          # replaced, not merged
    with atomic_dir(out, replace=False) as d:
        (d / "c.json").write_text("4")
    assert sorted(p.name for p in out.iterdir()) == ["b.json"]          # kept: it existed
    assert sorted(p.name for p in out.parent.iterdir()) == ["ckpt"]
