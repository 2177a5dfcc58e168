"""FAST-style action tokenizer: history alignment, round trip within the stated tolerance, save/load."""

import numpy as np
import pytest

from experience_dict.tokenizer import ActionTokenizer, align_groups


def smooth_episodes(n=12, T=120, seed=0):
    rng = np.random.default_rng(seed)
    eps = []
    for e in range(n):
        t = np.arange(T) / 80.0
        a = np.stack([np.sin(3 * t + e), np.cos(2 * t + e), 0.3 * np.sin(5 * t),
                      np.where(t > 0.5 + 0.05 * e, 1.0, -1.0)], -1)
        eps.append(np.clip(a + 0.03 * rng.standard_normal(a.shape), -1, 1).astype(np.float32))
    return eps


@pytest.fixture(scope="module")
def tok():
    return ActionTokenizer.fit(smooth_episodes(), r=4, relative_dims=[0, 1, 2], absolute_dims=[3], scale=10.0,
                               vocab_size=512)


def test_align_groups_hand_made_history():
    # H = 8 actions, r = 4 -> 2 groups; dims 0..2 relative, 3 absolute (gripper)
    a = np.array([[1, 0, 0, -1], [1, 1, 0, -1], [1, 0, 2, 1], [1, 0, 0, 1],
                  [0, 2, 0, 1], [0, 0, 0, 1], [3, 0, 0, -1], [0, 0, 1, -1]], dtype=np.float32)
    aligned, group_action, mask = align_groups(a[None], None, 4, [0, 1, 2], [3])
    assert aligned.shape == (1, 2, 4, 4) and group_action.shape == (1, 2, 4)
    np.testing.assert_allclose(group_action[0, 0], [4, 1, 2, 1])   # summed deltas, last gripper command
    np.testing.assert_allclose(group_action[0, 1], [3, 2, 1, -1])
    np.testing.assert_allclose(aligned[0, 0, :, 0], [1, 2, 3, 4])   # running sum within the group
    np.testing.assert_allclose(aligned[0, 0, :, 3], [-1, -1, 1, 1])  # absolute commands kept
    assert mask.tolist() == [[True, True]]
    # episode start: the first 5 steps are padding (sampler repeats the edge action there)
    pad = np.array([[True] * 5 + [False] * 3])
    aligned, group_action, mask = align_groups(a[None], pad, 4, [0, 1, 2], [3])
    assert mask.tolist() == [[False, True]]
    np.testing.assert_allclose(group_action[0, 1], [3, 0, 1, -1])  # padded step 4 adds no motion
    with pytest.raises(ValueError, match="multiple of r"):
        align_groups(a[None, :7], None, 4, [0, 1, 2], [3])
    with pytest.raises(ValueError, match="partition"):
        align_groups(a[None], None, 4, [0, 1], [3])


def test_round_trip_within_tolerance(tok):
    rep = tok.fit_report
    assert rep["n_groups"] > 1000 and 1.0 <= rep["mean_tokens_per_group"] <= tok.max_tokens_per_group
    assert rep["roundtrip_max_abs_error"] <= max(rep["tolerance"]) + 1e-6
    # unseen in-range histories
    eps = smooth_episodes(n=4, seed=1)
    hist = np.stack([e[10:26] for e in eps])  # (4, 16, 4)
    aligned, _, _ = align_groups(hist, None, 4, [0, 1, 2], [3])
    groups = aligned.reshape(-1, 4, 4)
    inside = ((groups >= tok.low) & (groups <= tok.high)).all(axis=(1, 2))
    dec = tok.decode(tok.encode(groups[inside]))
    assert np.all(np.abs(dec - groups[inside]) <= tok.tolerance + 1e-6)
    # BPE compresses: fewer tokens than coefficients on average
    assert np.mean([len(s) for s in tok.encode(groups)]) < tok.max_tokens_per_group


def test_encode_history_padding_and_save_load(tok, tmp_path):
    eps = smooth_episodes(n=3, seed=2)
    hist = np.stack([e[:16] for e in eps])
    pad = np.zeros((3, 16), bool)
    pad[0, :16] = True   # first step of an episode: nothing real
    pad[1, :6] = True
    out = tok.encode_history(hist, pad)
    assert out["tokens"].shape == (3, 4, 16) and out["tokens"].dtype == np.int64
    assert out["group_mask"].tolist() == [[False] * 4, [False, True, True, True], [True] * 4]
    assert np.array_equal(out["token_mask"], out["tokens"] != tok.pad_id)
    assert (out["tokens"][out["token_mask"]] < tok.vocab_size).all()
    # decoding the padded id rows gives back the aligned groups
    _aligned, group_action, _ = align_groups(hist, pad, 4, [0, 1, 2], [3])
    dec = tok.decode(out["tokens"].reshape(-1, 16)).reshape(3, 4, 4, 4)
    assert np.all(np.abs(dec[..., -1, :] - group_action) <= tok.tolerance + 1e-6)

    path = tmp_path / "tok.json"
    tok.save(path)
    assert path.read_text().lstrip().startswith("{")
    tok2 = ActionTokenizer.load(path)
    assert tok2.vocab_size == tok.vocab_size and tok2.fit_report == tok.fit_report
    assert np.array_equal(tok2.encode_history(hist, pad)["tokens"], out["tokens"])
    # memoised encodings: a second call (memo hits) equals a fresh tokenizer's, and the returned id lists are
    # copies (mutating them does not change later encodings)
    groups = align_groups(hist, pad, 4, [0, 1, 2], [3])[0].reshape(-1, 4, 4)
    assert tok2._memo and tok2.encode(groups) == ActionTokenizer.load(path).encode(groups)
    tok2.encode(groups)[0].append(-1)
    assert tok2.encode(groups) == [e.ids for e in tok2.bpe.encode_batch(tok2._to_string(tok2.coefficients(groups)))]


def test_bad_input_errors(tok, tmp_path):
    with pytest.raises(ValueError, match=r"expected \(\.\.\., 4, 4\)"):
        tok.encode(np.zeros((3, 5, 4)))
    with pytest.raises(ValueError, match="token id outside"):
        tok.decode([[tok.vocab_size + 5]])
    # a negative id is refused too (Python's indexing would wrap it to a valid token: decode(ids - V) == decode(ids))
    ids = tok.encode(np.zeros((1, 4, 4), np.float32))[0]
    assert len(ids) > 0 and tok.decode([ids]).shape == (1, 4, 4)
    with pytest.raises(ValueError, match="token id outside"):
        tok.decode([[int(i) - tok.vocab_size for i in ids]])
    with pytest.raises(ValueError, match="exceeds vocab_size"):
        ActionTokenizer.fit(smooth_episodes(n=2), r=4, relative_dims=[0, 1, 2], absolute_dims=[3], scale=1000.0,
                            vocab_size=64)
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="format"):
        ActionTokenizer.load(tmp_path / "bad.json")


def test_alphabet_past_the_utf16_surrogates_round_trips(tmp_path):
    """An alphabet of more than 35,328 coefficients (scale 10,000, r = 4, the gripper at -1 then +1) used to
    reach U+D800 and crash HF tokenizers' BpeTrainer; its code points now skip the surrogate block."""
    rng = np.random.default_rng(0)
    eps = []
    for _ in range(20):
        a = rng.uniform(-1, 1, (60, 4)).astype(np.float32)
        a[:30, 3], a[30:, 3] = -1.0, 1.0
        eps.append(a)
    tok = ActionTokenizer.fit(eps, r=4, relative_dims=[0, 1, 2], absolute_dims=[3], scale=10000, vocab_size=50000)
    assert tok.fit_report["alphabet_size"] > 0xD800 - 0x4E00
    assert not any(0xD800 <= ord(ch) < 0xE000 for t in tok._id_to_str for ch in t)
    groups, _, _ = align_groups(np.stack([e[:8] for e in eps]), None, 4, [0, 1, 2], [3])
    g = groups.reshape(-1, 4, 4)
    top = np.full_like(g[:1], 0.0)
    top[0, :, 3] = 1.0   # a group whose coefficients sit near the alphabet's top
    assert any(ord(ch) >= 0xE000 for s in tok._to_string(tok.coefficients(np.concatenate([g, top]))) for ch in s)
    for x in (g, top):
        x = np.clip(x, tok.low, tok.high)
        assert (np.abs(tok.decode(tok.encode(x)) - x) <= tok.tolerance + 1e-6).all()
    tok.save(tmp_path / "t.json")
    again = ActionTokenizer.load(tmp_path / "t.json")
    assert again.encode(g) == tok.encode(g)


def test_range_report_counts_clipped_groups(tok):
    """Actions past the fitted range are clipped by ``coefficients``; ``range_report`` counts them per dimension."""
    eps = smooth_episodes(n=3, seed=1)
    inside = tok.range_report(eps)
    assert inside["groups"] == 3 * (120 - 4 + 1) and inside["outside"] == 0 and inside["share"] == 0.0
    wide = [a * np.float32([1.5, 1.0, 1.0, 1.0]) for a in eps]   # the first dimension 1.5x wider
    rep = tok.range_report(wide)
    assert 0 < rep["outside"] == rep["outside_per_dim"][0] and rep["outside_per_dim"][1:] == [0, 0, 0]
    assert rep["share"] == rep["outside"] / rep["groups"] and rep["seen_high"][0] > rep["high"][0]
    # exactly the groups the tokenizer cannot round-trip within its tolerance
    groups = align_groups(np.stack([a[i:i + 4] for a in wide for i in range(117)]), None, 4, [0, 1, 2], [3])[0][:, 0]
    err = np.abs(tok.decode(tok.encode(groups)) - groups).max(axis=(1, 2))
    out = tok.outside_range(groups).any(1)
    assert out.sum() == rep["outside"] and (err[~out] <= tok.tolerance.max() + 1e-6).all()
    assert tok.range_report([])["groups"] == 0


def test_encode_when_the_memo_overflows(tok, monkeypatch):
    """The memo is bounded (MEMO_SIZE): a call whose new strings overflow it clears it and must still encode
    the strings it had memoised before (a KeyError on mw10 once the memo filled, experiment 31)."""
    import experience_dict.tokenizer as tk

    eps = smooth_episodes(n=4, seed=5)
    groups = align_groups(np.stack([e[:32] for e in eps]), np.zeros((4, 32), bool), 4, [0, 1, 2], [3])[0]
    groups = groups.reshape(-1, 4, 4)
    half = len(groups) // 2
    tok._memo.clear()
    tok.encode(groups[:half])                               # memoised: the first half
    monkeypatch.setattr(tk, "MEMO_SIZE", len(tok._memo) + 1)
    got = tok.encode(groups)                                # old strings + new ones overflow the memo
    assert got == [e.ids for e in tok.bpe.encode_batch(tok._to_string(tok.coefficients(groups)))]
    assert len(tok._memo) <= len(groups)
