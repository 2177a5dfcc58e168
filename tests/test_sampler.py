"""WindowDataset: named windows with offsets, edge-repeat padding with masks, DataLoader workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from experience_dict.sampler import WindowDataset
from experience_dict.store import ExperienceStore
from tests.test_store import expected_episode, new_store, write_episode

torch.set_num_threads(1)
WINDOWS = {"observation.state": ("observation.state", [-1, 0]),
           "observation.images.corner": ("observation.images.corner", [-1, 0]),
           "action": ("action", list(range(6))),
           "history.action": ("action", list(range(-3, 0)))}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    url = tmp_path_factory.mktemp("sampler") / "s"
    for wid in (0, 1):
        w = new_store(url).writer(f"u{wid}")
        for e in range(3):
            write_episode(w, wid, e, task=["reach-v3", "push-v3"][e % 2])
        w.close()
    return ExperienceStore.open(str(url))


def expected_window(ep: dict, key: str, t: int, offsets: list[int]):
    n = len(ep["action"])
    idx = np.asarray(offsets) + t
    return ep[key][np.clip(idx, 0, n - 1)], (idx < 0) | (idx >= n)


def test_windows_and_padding_at_both_ends(store):
    ds = WindowDataset(store, windows=WINDOWS, cache_bytes=1 << 20)
    eps = store.episodes()
    assert len(ds) == sum(e.length for e in eps)
    i = 0
    for e_idx, meta in enumerate(eps):
        wid, e = int(meta.shard[1:]), int(meta.episode_id.rsplit("-", 1)[1])
        want = expected_episode(wid, e)
        for t in range(meta.length):
            item = ds[i]
            assert (item["episode_index"], item["step"], item["task"], item["unit_id"]) == (e_idx, t, meta.task, wid)
            for name, (key, offs) in WINDOWS.items():
                vals, pad = expected_window(want, key, t, offs)
                np.testing.assert_array_equal(item[name].numpy(), vals, err_msg=f"{name} t={t}")
                np.testing.assert_array_equal(item[f"{name}_is_pad"].numpy(), pad)
            i += 1
    # explicit edge cases: first and last step of an episode
    first, last = ds[0], ds[eps[0].length - 1]
    assert first["observation.state_is_pad"].tolist() == [True, False]
    assert first["history.action_is_pad"].tolist() == [True, True, True]
    np.testing.assert_array_equal(first["history.action"][0], first["action"][0])  # repeats the first frame
    assert last["action_is_pad"].tolist() == [False] + [True] * 5
    assert torch.equal(last["action"][1], last["action"][0]) and torch.equal(last["action"][5], last["action"][0])
    assert first["observation.images.corner"].dtype == torch.uint8
    assert first["observation.images.corner"].shape == (2, 16, 16, 3)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_cache_off_matches_and_subset(store):
    eps = store.episodes(task="push-v3")
    a = WindowDataset(store, eps, windows=WINDOWS, cache_bytes=0)
    b = WindowDataset(store, eps, windows=WINDOWS)
    assert len(a) == sum(e.length for e in eps)
    for i in range(0, len(a), 3):
        x, y = a[i], b[i]
        for k in WINDOWS:
            assert torch.equal(x[k], y[k])
    assert b.cache_hits > 0 and a.cache_hits == 0


def test_dataloader_two_workers(store):
    ds = WindowDataset(store, windows=WINDOWS)
    ds[0]  # the parent reads first: workers must still open their own handles
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, num_workers=2)
    batches = list(loader)
    assert sum(len(b["step"]) for b in batches) == len(ds)
    batch = batches[1]
    assert batch["action"].shape == (8, 6, 4) and batch["observation.images.corner"].shape == (8, 2, 16, 16, 3)
    for j in range(8):
        assert torch.equal(batch["action"][j], ds[8 + j]["action"])
    assert isinstance(batch["task"], list) and len(batch["task"]) == 8
    # batched path: whole batches built by the workers, identical to default collation
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), 8, drop_last=False)
    fast = list(torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=None, num_workers=2))
    assert len(fast) == len(batches)
    for b1, b2 in zip(batches, fast):
        assert set(b1) == set(b2)
        for k in b1:
            assert b1[k] == b2[k] if k == "task" else torch.equal(b1[k], b2[k]), k


def test_bad_windows(store):
    with pytest.raises(KeyError, match="observation.depth"):
        WindowDataset(store, windows={"d": ("observation.depth", [0])})
    with pytest.raises(ValueError, match="offsets"):
        WindowDataset(store, windows={"a": ("action", [])})
    with pytest.raises(ValueError, match="at least one episode"):
        WindowDataset(store, episodes=[], windows=WINDOWS)
