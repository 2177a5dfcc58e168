"""Checkpoint registry: atomic versioned publish, sha256-verified fetch, tampering and pickles refused."""

import json

import pytest
import torch

from fleet.acting import load_checkpoint
from fleet.registry import (
    MANIFEST,
    CheckpointRegistry,
    ChecksumMismatchError,
    RegistryError,
    verify_checkpoint_dir,
)
from policies.mlp_chunk import MLPChunkConfig, MLPChunkPolicy


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    policy = MLPChunkPolicy(MLPChunkConfig(hidden_dim=16, n_layers=2),
                            stats={"observation.state": {"mean": [0.0, 0.6, 0.2, 0.5], "std": [0.1] * 4}})
    return policy, policy.save_pretrained(tmp_path / "ckpt")


@pytest.mark.parametrize("url_kind", ["local", "memory"])
def test_publish_fetch_roundtrip(tmp_path, ckpt, url_kind):
    policy, path = ckpt
    url = str(tmp_path / "reg") if url_kind == "local" else f"memory://reg-{tmp_path.name}"
    reg = CheckpointRegistry(url)
    assert reg.latest_version() is None and reg.versions() == []
    with pytest.raises(RegistryError, match="no published version"):
        reg.fetch(None, tmp_path / "x")
    assert reg.publish(path, {"step": 10}) == 1
    assert reg.publish(path, {"step": 20}) == 2
    assert reg.versions() == [1, 2] and reg.latest_version() == 2
    man = reg.manifest(2)
    assert man["metadata"] == {"step": 20} and set(man["files"]) == {"model.safetensors", "config.json", "stats.json"}
    local = reg.fetch(None, tmp_path / "fetched")
    assert verify_checkpoint_dir(local)["version"] == 2
    model, version = load_checkpoint(local)
    assert version == 2
    obs = {"observation.state": torch.randn(3, 4), "observation.environment_state": torch.randn(3, 17)}
    torch.testing.assert_close(model.predict_action_chunk(obs), policy.eval().predict_action_chunk(obs))
    with pytest.raises(RegistryError, match="version 7 is not published"):
        reg.fetch(7, tmp_path / "y")


def test_tampered_checkpoint_refused(tmp_path, ckpt):
    _, path = ckpt
    reg = CheckpointRegistry(tmp_path / "reg")
    v = reg.publish(path)
    weights = tmp_path / "reg" / f"v{v:06d}" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # flip one byte of the weights
    weights.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="model.safetensors.*refusing a tampered"):
        reg.fetch(v, tmp_path / "local")
    assert not (tmp_path / "local").exists()  # nothing unverified left behind
    assert not list(tmp_path.glob(".local.*.tmp"))
    # a tampered local copy is refused by the loader too
    good = CheckpointRegistry(tmp_path / "reg2")
    local = good.fetch(good.publish(path), tmp_path / "local2")
    cfg = json.loads((local / "config.json").read_text())
    cfg["hidden_dim"] = 32
    (local / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChecksumMismatchError, match="config.json"):
        load_checkpoint(local)


def test_publish_is_atomic_and_refuses_pickles(tmp_path, ckpt):
    _, path = ckpt
    reg = CheckpointRegistry(tmp_path / "reg")
    # a version directory without a manifest (a publisher that died mid-publish) is invisible
    (tmp_path / "reg" / "v000001").mkdir(parents=True)
    (tmp_path / "reg" / "v000001" / "model.safetensors").write_bytes(b"partial")
    assert reg.latest_version() is None
    assert reg.publish(path) == 2 and reg.versions() == [2]
    assert not list((tmp_path / "reg" / "staging").iterdir())
    assert (tmp_path / "reg" / "v000002" / MANIFEST).is_file()
    torch.save({"w": torch.zeros(1)}, path / "extra.pt")
    with pytest.raises(RegistryError, match="extra.pt.*pickle"):
        reg.publish(path)
    (path / "extra.pt").unlink()
    with pytest.raises(RegistryError, match="JSON-able"):
        reg.publish(path, {"bad": object()})
    with pytest.raises(RegistryError, match="not a directory"):
        reg.publish(tmp_path / "nope")
