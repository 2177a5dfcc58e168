"""Action Experience Dictionary module: shapes, null vector for padded history, group alignment."""

import numpy as np
import pytest
import torch

from experience_dict.aed import ActionExperienceDictionary
from experience_dict.tokenizer import ActionTokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    rng = np.random.default_rng(0)
    eps = [np.clip(np.cumsum(rng.normal(0, 0.1, (80, 4)), 0), -1, 1).astype(np.float32) for _ in range(8)]
    return ActionTokenizer.fit(eps, r=4, relative_dims=[0, 1, 2], absolute_dims=[3], vocab_size=256)


@pytest.mark.parametrize("pooling", ["mean", "attention"])
def test_shapes_and_null_vector(tok, pooling):
    torch.manual_seed(0)
    aed = ActionExperienceDictionary(tok.vocab_size, 32, num_groups=4, max_tokens_per_group=tok.max_tokens_per_group,
                                     pooling=pooling)
    rng = np.random.default_rng(1)
    hist = np.clip(rng.normal(0, 0.3, (3, 16, 4)), -1, 1).astype(np.float32)
    pad = np.zeros((3, 16), bool)
    pad[0] = True          # episode start: fully padded history
    pad[1, :8] = True      # two padded groups
    t = {k: torch.from_numpy(v) for k, v in tok.encode_history(hist, pad).items()}
    out = aed(t["tokens"], t["token_mask"], t["group_mask"])
    assert out.shape == (3, 4, 32) and torch.isfinite(out).all()
    null = aed.null + aed.group_pos  # (4, 32)
    torch.testing.assert_close(out[0], null)
    torch.testing.assert_close(out[1, :2], null[:2])
    assert not torch.allclose(out[1, 2:], null[2:])
    # tokens of padded groups do not matter
    t2 = t["tokens"].clone()
    t2[1, :2] = 0
    torch.testing.assert_close(aed(t2, t2 != tok.pad_id, t["group_mask"])[1], out[1])
    # each real group = masked mean over its slots of proj(embed(token)) + token_pos (written out per group)
    for b, g in [(1, 2), (1, 3), (2, 0), (2, 3)] if pooling == "mean" else []:
        m = t["token_mask"][b, g]
        ref = aed.proj(aed.embed(t["tokens"][b, g][m])) + aed.token_pos[m]
        torch.testing.assert_close(out[b, g], ref.mean(0) + aed.group_pos[g], atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert aed.embed.weight.grad.abs().sum() > 0 and aed.null.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="expected"):
        aed(t["tokens"][:, :3], t["token_mask"][:, :3], t["group_mask"][:, :3])


def test_group_alignment_reaches_the_embedding(tok):
    """Groups aligned by frame interval: two histories whose actions differ only inside group 2 give
    identical vectors for groups 0, 1, 3 and a different one for group 2."""
    torch.manual_seed(0)
    aed = ActionExperienceDictionary(tok.vocab_size, 16, 4, tok.max_tokens_per_group)
    h = np.zeros((2, 16, 4), np.float32)
    h[:, :, 3] = -1.0
    h[1, 8:12, 0] = 0.2   # motion in frame interval 2 only (steps -8..-5)
    h[1, 11, 3] = 1.0     # gripper closes at the end of interval 2
    t = {k: torch.from_numpy(v) for k, v in tok.encode_history(h).items()}
    assert torch.equal(t["tokens"][0, [0, 1, 3]], t["tokens"][1, [0, 1, 3]])
    assert not torch.equal(t["tokens"][0, 2], t["tokens"][1, 2])
    out = aed(t["tokens"], t["token_mask"], t["group_mask"])
    torch.testing.assert_close(out[0, [0, 1, 3]], out[1, [0, 1, 3]])
    assert not torch.allclose(out[0, 2], out[1, 2])
    # the decoded tokens of group 2 carry the interval's summed motion and the last gripper command
    dec = tok.decode(t["tokens"][1, 2:3].numpy())[0, -1]
    assert abs(dec[0] - 0.8) <= tok.tolerance[0] and abs(dec[3] - 1.0) <= tok.tolerance[3]
