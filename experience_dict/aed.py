"""The Action Experience Dictionary (AED): learned embeddings of tokenized action-history groups.

After the AED paper and its public code as summarised in docs/AED.md:
a learned embedding table over action-token ids, an MLP projector (LayerNorm -> GELU MLP -> LayerNorm),
a learned token-slot embedding, per-group pooling of the group's tokens (mean; attention pooling optional) and a learned group position
embedding, giving one vector per frame interval of the history window. Groups without any real action
(before the episode start) are replaced by a learned null vector, so a fully padded history (the first step
of an episode) still yields well-defined vectors and no attention row is fully masked downstream.

Tokens come from ``experience_dict.tokenizer.ActionTokenizer.encode_history`` (CPU preprocessor).
"""

from __future__ import annotations

import torch
from torch import nn


class ActionExperienceDictionary(nn.Module):
    """Embeds tokenized action groups to one vector per group.

    Args:
        vocab_size: number of action-token ids (``ActionTokenizer.vocab_size``); id ``vocab_size`` is padding.
        dim: output width D.
        num_groups: G, groups per history window (H // r).
        max_tokens_per_group: L, token slots per group (``ActionTokenizer.max_tokens_per_group``).
        token_dim: width of the embedding table (default ``dim``).
        pooling: "mean" (masked mean over a group's tokens) or "attention" (one learned query, masked
            softmax attention over the group's tokens).
        mlp_ratio: hidden width of the projector MLP as a multiple of ``dim``.
    """

    def __init__(self, vocab_size: int, dim: int, num_groups: int, max_tokens_per_group: int,
                 token_dim: int | None = None, pooling: str = "mean", mlp_ratio: float = 2.0):
        super().__init__()
        if pooling not in ("mean", "attention"):
            raise ValueError(f"pooling: expected 'mean' or 'attention', given {pooling!r}")
        token_dim = token_dim or dim
        self.vocab_size, self.num_groups, self.max_tokens = vocab_size, num_groups, max_tokens_per_group
        self.pooling = pooling
        self.embed = nn.Embedding(vocab_size + 1, token_dim, padding_idx=vocab_size)
        hidden = int(dim * mlp_ratio)
        self.proj = nn.Sequential(nn.LayerNorm(token_dim), nn.Linear(token_dim, hidden), nn.GELU(),
                                  nn.Linear(hidden, dim), nn.LayerNorm(dim))
        self.token_pos = nn.Parameter(torch.randn(max_tokens_per_group, dim) * 0.02)  # slot in the group
        if pooling == "attention":
            self.pool_query = nn.Parameter(torch.randn(dim) * 0.02)
        self.group_pos = nn.Parameter(torch.randn(num_groups, dim) * 0.02)
        self.null = nn.Parameter(torch.randn(dim) * 0.02)

    def forward(self, tokens: torch.Tensor, token_mask: torch.Tensor, group_mask: torch.Tensor) -> torch.Tensor:
        """Pool each group's token embeddings.

        Args:
            tokens: (B, G, L) int64 token ids (``vocab_size`` = padding).
            token_mask: (B, G, L) bool, True = real token.
            group_mask: (B, G) bool, True = group holds a real action; False groups get the null vector.
        Returns:
            (B, G, dim) float group vectors (group position embedding added).
        Raises:
            ValueError: on shapes other than (B, num_groups, max_tokens_per_group).
        """
        if tokens.ndim != 3 or tokens.shape[1:] != (self.num_groups, self.max_tokens):
            raise ValueError(f"AED tokens: expected (B, {self.num_groups}, {self.max_tokens}), "
                             f"given {tuple(tokens.shape)}")
        if torch.onnx.is_in_onnx_export():  # a traced graph cannot size a tensor by the batch's distinct ids
            return self._forward_direct(tokens, token_mask, group_mask)
        # proj(embed(id)) depends on the id only: project each distinct id of the batch once.
        ids, inverse = torch.unique(tokens, return_inverse=True)
        table = self.proj(self.embed(ids))  # (U, D)
        if self.pooling == "mean":
            # masked mean of (table[id] + token_pos) over a group's slots, as two matmuls: per-group counts of
            # each distinct id (B*G, U) @ table, plus mask (B*G, L) @ token_pos; no (B, G, L, D) tensor.
            m = token_mask.to(table.dtype).reshape(-1, self.max_tokens)  # (B*G, L)
            counts = torch.zeros(m.shape[0], len(ids), dtype=table.dtype, device=table.device)
            counts.scatter_add_(1, inverse.reshape(m.shape), m)
            n = m.sum(-1, keepdim=True).clamp_min(1.0)
            pooled = ((counts @ table + m @ self.token_pos) / n).view(*tokens.shape[:2], -1)
        else:
            x = table[inverse] + self.token_pos  # (B, G, L, D)
            logits = (x @ self.pool_query) / x.shape[-1] ** 0.5  # (B, G, L)
            logits = logits.masked_fill(~token_mask, float("-inf"))
            w = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # all-pad groups -> zeros (replaced below)
            pooled = (w.unsqueeze(-1) * x).sum(-2)
        valid = (group_mask & token_mask.any(-1)).unsqueeze(-1)
        pooled = torch.where(valid, pooled, self.null.to(pooled.dtype))
        return pooled + self.group_pos

    def _forward_direct(self, tokens: torch.Tensor, token_mask: torch.Tensor, group_mask: torch.Tensor) -> torch.Tensor:
        """``forward`` without ``torch.unique``: every slot's embedding projected, shapes fixed by (B, G, L) (the
        ONNX export's path; the same values up to float rounding, tests/test_aed.py)."""
        x = self.proj(self.embed(tokens)) + self.token_pos  # (B, G, L, D)
        if self.pooling == "mean":
            m = token_mask.to(x.dtype).unsqueeze(-1)
            pooled = (x * m).sum(-2) / m.sum(-2).clamp_min(1.0)
        else:
            logits = (x @ self.pool_query) / x.shape[-1] ** 0.5
            logits = logits.masked_fill(~token_mask, float("-inf"))
            pooled = (torch.softmax(logits, dim=-1).nan_to_num(0.0).unsqueeze(-1) * x).sum(-2)
        valid = (group_mask & token_mask.any(-1)).unsqueeze(-1)
        pooled = torch.where(valid, pooled, self.null.to(pooled.dtype))
        return pooled + self.group_pos
