"""The AED diffusion policy: a DiT-style transformer denoiser over action chunks, conditioned on the
current observation and on an Action Experience Dictionary prefix.

Method (docs/AED.md; after the AED paper's public code):
- Observation encoders give tokens per frame: one token per state key (MLP), ``image_pool**2`` tokens per
  camera (ResNet-style convnet with GroupNorm, He et al. 2016 / Wu & He 2018; written here, no downloads).
- Visual memory: ``M`` learned queries (self-attn -> cross-attn to the history frames' tokens -> FFN).
- AED: the action history (last ``H`` actions, ``G = H / r`` groups) is tokenized on the CPU by the FAST-style
  ``ActionTokenizer`` and embedded by ``ActionExperienceDictionary``; the ``G`` group vectors cross-attend to
  the visual memory and become a prefix of the denoiser sequence.
- Denoiser: transformer over ``[current-obs tokens; prefix; noisy action tokens]`` with adaLN-Zero timestep
  modulation (DiT, Peebles & Xie 2023); observation and prefix tokens are modulated with timestep 0. Mask:
  obs tokens see obs tokens; prefix tokens see obs + prefix; action tokens see obs + prefix + actions.
  Since obs and prefix tokens see neither actions nor t, their hidden states are computed once per action
  chunk at sampling time (keys/values cached per block) and every DDIM step runs only the action tokens.
- Diffusion: DDPM training, DDIM sampling (``diffusers`` schedulers; Ho et al. 2020, Song et al. 2021),
  squared-cosine betas and epsilon prediction as in Diffusion Policy (Chi et al. 2023).
- Motion-aware transition (MT) loss: random start ``s`` and span ``k`` over the chunk's future frame
  intervals; a small decoder reads frame ``s``'s features and cross-attends to the denoiser's hidden states
  of actions ``[s*r, (s+k)*r)`` to predict ``f(o_{s+k}) - f(o_s)`` of a frozen extractor ``f``; loss = MSE of
  the L2-normalized prediction and target. ``f``: the normalized state keys, concatenated (state-only), plus
  for each camera a frozen, fixed-seed random-init convnet's pooled features (random conv features; no
  pretrained weights are downloaded).

Batches are dicts from ``experience_dict.sampler.WindowDataset`` with the windows of ``window_spec()``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler
from torch import nn

from experience_dict.aed import ActionExperienceDictionary
from experience_dict.tokenizer import ActionTokenizer
from policies.aed_diffusion.configuration_aed_diffusion import AEDDiffusionConfig, migrate_checkpoint_config
from policies.aed_diffusion.normalization import Normalizer, normalize_image
from policies.base import PreTrainedPolicy
from policies.features import POINT_COLORS

CONFIG_NAME, WEIGHTS_NAME, STATS_NAME, TOKENIZER_NAME = "config.json", "model.safetensors", "stats.json", "tokenizer.json"


# ----------------------------------------------------------------------------- building blocks
class Attention(nn.Module):
    """Multi-head attention on ``F.scaled_dot_product_attention``; bool masks: True = may attend."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.q, self.kv, self.o = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def keys_values(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx (B, M, D) -> keys, values (B, heads, M, D / heads) each."""
        k, v = self.kv(ctx).view(ctx.shape[0], ctx.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x: (B, N, D) queries; ctx: (B, M, D) keys/values (default x); mask: (N, M') or (B, 1, N, M') bool.

        past_kv: keys/values (B, heads, P, D / heads) of earlier tokens (a cache, see ``Denoiser.condition``)
        put before those of ``ctx``, so M' = P + M. Returns (B, N, D).
        """
        B, N, D = x.shape
        q = self.q(x).view(B, N, self.heads, -1).transpose(1, 2)
        k, v = self.keys_values(x if ctx is None else ctx)
        if past_kv is not None:
            k = torch.cat([past_kv[0].expand(B, -1, -1, -1), k], 2)
            v = torch.cat([past_kv[1].expand(B, -1, -1, -1), v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.o(out.transpose(1, 2).reshape(B, N, D))


def mlp(dim: int, ratio: float, dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, int(dim * ratio)), nn.GELU(), nn.Dropout(dropout),
                         nn.Linear(int(dim * ratio), dim))


class CrossBlock(nn.Module):
    """Pre-LN block: [self-attn ->] cross-attn to a context -> FFN (residual each)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float, self_attn: bool):
        super().__init__()
        self.self_attn = Attention(dim, heads, dropout) if self_attn else None
        self.n0 = nn.LayerNorm(dim) if self_attn else None
        self.n1, self.nc, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.cross, self.ffn = Attention(dim, heads, dropout), mlp(dim, mlp_ratio, dropout)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor | None = None):
        """x: (B, N, D); ctx: (B, M, D); ctx_mask: (B, M) bool, True = valid key."""
        if self.self_attn is not None:
            shared = x.shape[0] > 1 and x.stride(0) == 0 and not (self.training and self.self_attn.dropout > 0)
            if shared:  # learned queries expanded over the batch: every row is the same, attend once
                x = (x[:1] + self.self_attn(self.n0(x[:1]))).expand_as(x)
            else:
                x = x + self.self_attn(self.n0(x))
        mask = None if ctx_mask is None else ctx_mask[:, None, None, :]
        x = x + self.cross(self.n1(x), self.nc(ctx), mask)
        return x + self.ffn(self.n2(x))


class ResBlock(nn.Module):
    """ResNet basic block with GroupNorm (He et al. 2016; GroupNorm: Wu & He 2018)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        g = lambda c: nn.GroupNorm(min(8, c), c)
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), g(cout), nn.ReLU(inplace=True),
                                  nn.Conv2d(cout, cout, 3, 1, 1, bias=False), g(cout))
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), g(cout)))

    def forward(self, x):
        return F.relu(self.body(x) + self.skip(x))


class ImageEncoder(nn.Module):
    """Small ResNet: stride-2 stem, one stride-2 ``ResBlock`` per stage, adaptive average pool to
    ``pool x pool`` cells. (B, 3, H, W) float in [-1, 1] -> (B, pool*pool, channels[-1])."""

    def __init__(self, channels: list[int], pool: int):
        super().__init__()
        c0 = channels[0]
        layers = [nn.Conv2d(3, c0, 3, 2, 1, bias=False), nn.GroupNorm(min(8, c0), c0), nn.ReLU(inplace=True)]
        for cin, cout in zip([c0] + channels[:-1], channels):
            layers.append(ResBlock(cin, cout, 2))
        self.net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(pool))
        self.out_dim = channels[-1]

    def forward(self, x):
        return self.net(x).flatten(2).transpose(1, 2)


class PointEncoder(nn.Module):
    """DP3's point encoder (Ze et al., "3D Diffusion Policy", RSS 2024): a shared MLP over points, each layer
    Linear -> LayerNorm -> ReLU, then the maximum over the points (order-invariant), then a Linear to ``out_dim``.
    (..., N, in_dim) normalized coordinates (3; +3 with each point's offset from the hand, +3 with its colour;
    ``AEDDiffusionConfig.point_in_dim``) -> (..., out_dim). Trained
    from scratch; no pretrained weights."""

    def __init__(self, channels: list[int], out_dim: int, in_dim: int = 3):
        super().__init__()
        layers, cin = [], int(in_dim)
        for c in channels:
            layers += [nn.Linear(cin, c), nn.LayerNorm(c), nn.ReLU(inplace=True)]
            cin = c
        self.mlp = nn.Sequential(*layers)
        self.proj = nn.Linear(cin, out_dim)

    def forward(self, x):
        return self.proj(self.mlp(x).amax(dim=-2))


def point_features(cloud: torch.Tensor, centre: torch.Tensor, half: torch.Tensor,
                   hand: torch.Tensor | None = None, colors: torch.Tensor | None = None) -> torch.Tensor:
    """A point encoder's input: (..., N, 3) raw cloud (metres) -> (..., N, 3) coordinates ``(p - centre) / half`` per
    axis; with ``hand`` ((..., 3) metres, the cloud's frame) also each point's offset from the hand
    ``(p - hand) / half`` (3 more); with ``colors`` ((..., N, 3) uint8 RGB, or float 0..255) also each point's colour
    in [-1, 1] (3 more, last). The policy (``point_relative``, ``point_color``) and its critic's frozen copy both call
    this."""
    p = cloud.float()
    parts = [(p - centre) / half]
    if hand is not None:
        parts.append((p - hand.float()[..., None, :]) / half)
    if colors is not None:
        parts.append(colors.float() / 127.5 - 1.0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


class ObsEncoder(nn.Module):
    """Tokens per frame: one per state key (MLP), ``pool**2`` per camera, one per point cloud (DP3's encoder), plus
    a learned token-type embedding.

    forward(frames: {key: (B, T, d) normalized | (B, T, 3, H, W) in [-1, 1] | (B, T, N, 3) normalized})
    -> (B, T, K, dim).
    """

    def __init__(self, cfg: AEDDiffusionConfig):
        super().__init__()
        self.state_keys, self.image_keys, self.point_keys = cfg.state_keys, cfg.image_keys, cfg.point_keys
        self.points = nn.ModuleDict({k.replace(".", "_"): PointEncoder(cfg.point_channels, cfg.dim, cfg.point_in_dim)
                                     for k in self.point_keys})
        self.state = nn.ModuleDict({k.replace(".", "_"): nn.Sequential(
            nn.Linear(cfg.input_shapes[k][0], cfg.state_hidden), nn.GELU(), nn.Linear(cfg.state_hidden, cfg.dim))
            for k in self.state_keys})
        self.images = nn.ModuleDict({k.replace(".", "_"): ImageEncoder(cfg.image_channels, cfg.image_pool)
                                     for k in self.image_keys})
        self.image_proj = nn.ModuleDict({k.replace(".", "_"): nn.Linear(cfg.image_channels[-1], cfg.dim)
                                         for k in self.image_keys})
        self.tokens_per_frame = len(self.state_keys) + len(self.image_keys) * cfg.image_pool ** 2 + len(self.point_keys)
        self.type_emb = nn.Parameter(torch.randn(self.tokens_per_frame, cfg.dim) * 0.02)

    def forward(self, frames: dict[str, torch.Tensor]) -> torch.Tensor:
        toks = []
        for k in self.state_keys:
            toks.append(self.state[k.replace(".", "_")](frames[k]).unsqueeze(-2))
        for k in self.point_keys:
            toks.append(self.points[k.replace(".", "_")](frames[k]).unsqueeze(-2))
        for k in self.image_keys:
            x = frames[k]
            B, T = x.shape[:2]
            f = self.image_proj[k.replace(".", "_")](self.images[k.replace(".", "_")](x.flatten(0, 1)))
            toks.append(f.view(B, T, *f.shape[1:]))
        return torch.cat(toks, dim=-2) + self.type_emb


class FrozenFeatures(nn.Module):
    """Frozen feature extractor ``f`` for the MT loss targets (no trainable parameters).

    ``f(o)`` = concat(normalized state keys, for each camera: a fixed-seed random-init ``ImageEncoder``
    pooled to one vector and linearly mapped to ``image_feature_dim``, for each point cloud: a fixed-seed random-init
    ``PointEncoder`` to ``image_feature_dim``). forward: {key: (B, T, ...)} -> (B, T, F).
    """

    def __init__(self, cfg: AEDDiffusionConfig):
        super().__init__()
        self.state_keys, self.image_keys, self.point_keys = cfg.state_keys, cfg.image_keys, cfg.point_keys
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            self.images = nn.ModuleDict({k.replace(".", "_"): nn.Sequential(
                ImageEncoder(cfg.image_channels, 1), nn.Flatten(),
                nn.Linear(cfg.image_channels[-1], cfg.mt_loss.image_feature_dim)) for k in self.image_keys})
            self.points = nn.ModuleDict({k.replace(".", "_"): PointEncoder(
                cfg.point_channels, cfg.mt_loss.image_feature_dim, cfg.point_in_dim)
                for k in self.point_keys})
        self.requires_grad_(False)
        self.dim = sum(cfg.input_shapes[k][0] for k in self.state_keys) + \
            (len(self.image_keys) + len(self.point_keys)) * cfg.mt_loss.image_feature_dim

    @torch.no_grad()
    def forward(self, frames: dict[str, torch.Tensor]) -> torch.Tensor:
        feats = [frames[k] for k in self.state_keys]
        feats += [self.points[k.replace(".", "_")](frames[k]) for k in self.point_keys]
        for k in self.image_keys:
            x = frames[k]
            feats.append(self.images[k.replace(".", "_")](x.flatten(0, 1)).view(*x.shape[:2], -1))
        return torch.cat(feats, dim=-1).float()


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (B,) timesteps -> (B, dim) (Vaswani et al. 2017; DiT's TimestepEmbedder)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class DiTBlock(nn.Module):
    """adaLN-Zero transformer block (Peebles & Xie 2023) with per-token modulation.

    ``modulation(c)`` gives, per conditioning vector, [shift1, 1 + scale1, gate1, shift2, 1 + scale2, gate2]
    (= ``ada(c)`` with the 1 of ``x * (1 + scale) + shift`` folded in).
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float):
        super().__init__()
        self.n1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.n2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn, self.ffn = Attention(dim, heads, dropout), mlp(dim, mlp_ratio, dropout)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        nn.init.zeros_(self.ada[1].weight)
        nn.init.zeros_(self.ada[1].bias)
        one = torch.zeros(6, dim)
        one[[1, 4]] = 1.0
        self.register_buffer("one", one.flatten(), persistent=False)

    def modulation(self, c: torch.Tensor) -> torch.Tensor:
        """(..., D) conditioning -> (..., 6D) [shift1, 1 + scale1, gate1, shift2, 1 + scale2, gate2]."""
        return self.ada(c) + self.one

    def forward(self, x, mod, mask=None, past_kv=None):
        """x: (B, N, D); mod: (B | 1, N | 1, 6D) ``modulation`` of each token's conditioning; mask: (N, P + N)
        bool; past_kv: cached keys/values (B | 1, heads, P, D / heads) of earlier tokens x may attend to.
        -> (B, N, D)."""
        sh1, sc1, g1, sh2, sc2, g2 = mod.chunk(6, dim=-1)
        x = torch.addcmul(x, g1, self.attn(torch.addcmul(sh1, self.n1(x), sc1), mask=mask, past_kv=past_kv))
        return torch.addcmul(x, g2, self.ffn(torch.addcmul(sh2, self.n2(x), sc2)))

    def keys_values(self, x, mod):
        """The attention keys/values (B, heads, N, D / heads) this block computes for tokens x (B, N, D)."""
        sh1, sc1 = mod[..., : 2 * x.shape[-1]].chunk(2, dim=-1)
        return self.attn.keys_values(torch.addcmul(sh1, self.n1(x), sc1))


def denoiser_mask(n_obs: int, n_prefix: int, n_act: int) -> torch.Tensor:
    """(N, N) bool attention mask over ``[obs; prefix; actions]``, True = row may attend to column.

    Obs tokens see obs; prefix tokens see obs + prefix; action tokens see obs + prefix + actions (docs/AED.md).
    """
    N = n_obs + n_prefix + n_act
    m = torch.zeros(N, N, dtype=torch.bool)
    m[:, :n_obs] = True
    m[n_obs:, n_obs:n_obs + n_prefix] = True
    m[n_obs + n_prefix:, n_obs + n_prefix:] = True
    return m


class Denoiser(nn.Module):
    """DiT-style denoiser of a normalized action chunk over ``[obs tokens; prefix; noisy action tokens]``.

    forward(noisy (B, horizon, A), t (B,) | () int, obs_tokens (B, No, D), prefix (B, G, D) | None)
      -> (prediction (B, horizon, A), action hidden states (B, horizon / P, D) after the last block, P = ``action_patch``).

    ``forward_masked`` is the literal form: the whole sequence through every block under ``denoiser_mask``,
    obs and prefix tokens modulated with timestep 0. There the obs and prefix tokens never attend to action
    tokens, so their hidden states depend neither on the noisy actions nor on t. ``forward`` computes the
    same thing in two streams: ``condition`` runs the obs + prefix tokens (mask restricted to them) and keeps
    each block's keys/values; ``denoise`` runs the action tokens, which attend to those cached keys/values
    and their own (their mask rows are all True). Sampling calls ``condition`` once per chunk and ``denoise``
    at every DDIM step. All three agree up to float rounding (tests/test_policy.py).

    Shape fields (docs/AED.md): ``action_patch`` P consecutive actions form one action token (horizon / P
    tokens); ``condition_layers`` C: only the first C blocks update the obs and prefix tokens, later blocks attend
    to their state after block C (0: every block cross-attends to the input tokens; None: every block).
    """

    def __init__(self, cfg: AEDDiffusionConfig, n_obs_tokens: int, n_prefix: int):
        super().__init__()
        D, A, P = cfg.dim, cfg.action_dim, cfg.action_patch
        self.dim, self.n_obs, self.n_prefix, self.horizon = D, n_obs_tokens, n_prefix, cfg.horizon
        self.patch, self.n_act = P, cfg.horizon // P  # P consecutive actions per action token
        # blocks that update the obs/prefix tokens (later blocks attend to their state after the last of these)
        self.cond_layers = cfg.n_layers if cfg.condition_layers is None else cfg.condition_layers
        self.act_in = nn.Linear(A * P, D)
        self.act_pos = nn.Parameter(torch.randn(self.n_act, D) * 0.02)
        self.t_mlp = nn.Sequential(nn.Linear(D, D * 2), nn.SiLU(), nn.Linear(D * 2, D))
        self.blocks = nn.ModuleList(DiTBlock(D, cfg.n_heads, cfg.mlp_ratio, cfg.dropout) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(D, 2 * D))
        self.out = nn.Linear(D, A * P)
        for lin in (self.final_ada[1], self.out):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        n_cond = n_obs_tokens + n_prefix
        self.register_buffer("mask", denoiser_mask(n_obs_tokens, n_prefix, self.n_act), persistent=False)
        self.register_buffer("cond_mask", denoiser_mask(n_obs_tokens, n_prefix, 0), persistent=False)
        is_act = (torch.arange(n_cond + self.n_act) >= n_cond).float()
        # (N, 2) one-hot of each token's conditioning [timestep 0, timestep t] (forward_masked's modulation)
        self.register_buffer("token_type", torch.stack([1 - is_act, is_act], 1), persistent=False)

    def timestep_conditioning(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) int timesteps -> (B, D) conditioning vectors ``t_mlp(sinusoidal(t))``."""
        return self.t_mlp(timestep_embedding(t, self.dim))

    def forward(self, noisy, t, obs_tokens, prefix=None):
        return self.denoise(noisy, t, self.condition(obs_tokens, prefix))

    def forward_masked(self, noisy, t, obs_tokens, prefix=None):
        """The same as ``forward``, as one masked sequence ``[obs; prefix; actions]`` (reference path)."""
        B = noisy.shape[0]
        t = t.expand(B) if t.ndim else t.reshape(1).expand(B)
        c = self.timestep_conditioning(torch.cat([t.new_zeros(1), t]))  # (1 + B, D): [timestep 0; timestep t]
        parts = [obs_tokens] + ([prefix] if prefix is not None else []) + [self._action_tokens(noisy)]
        x = torch.cat(parts, dim=1)
        n_cond = x.shape[1] - self.n_act
        for i, blk in enumerate(self.blocks):
            mod = blk.modulation(c)
            y = blk(x, self.token_type @ torch.stack([mod[:1].expand(B, -1), mod[1:]], 1), self.mask)
            x = y if i < self.cond_layers else torch.cat([x[:, :n_cond], y[:, n_cond:]], 1)
        return self._head(x[:, -self.n_act:], self.final_ada(c[1:]).unsqueeze(1))

    def _action_tokens(self, noisy):
        """(B, horizon, A) noisy actions -> (B, horizon / P, D) action tokens (P consecutive actions each)."""
        B, T, A = noisy.shape
        return self.act_in(noisy.reshape(B, T // self.patch, A * self.patch)) + self.act_pos

    def _head(self, h, final_mod):
        """Final adaLN (final_mod: (B | 1, 1, 2D) = [shift, scale]) and output layer -> (prediction
        (B, horizon, A), h (B, horizon / P, D))."""
        sh, sc = final_mod.chunk(2, dim=-1)
        out = self.out(torch.addcmul(sh, self.final_norm(h), 1 + sc))
        return out.reshape(h.shape[0], self.horizon, -1), h

    def condition(self, obs_tokens, prefix=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run the obs and prefix tokens (B, No, D), (B, G, D) | None through the blocks at timestep 0.

        Returns, per block, the keys and values (B, heads, No + G, D / heads) the action tokens attend to
        (the cache ``denoise`` takes).
        """
        x = obs_tokens if prefix is None else torch.cat([obs_tokens, prefix], dim=1)
        c0 = self.timestep_conditioning(torch.zeros(1, dtype=torch.long, device=x.device))  # (1, D)
        mask = None if prefix is None else self.cond_mask
        cache = []
        for i, blk in enumerate(self.blocks):
            mod = blk.modulation(c0).unsqueeze(1)  # (1, 1, 6D): the same for every sample and token
            cache.append(blk.keys_values(x, mod))
            # the last block's outputs of these tokens are never read; past cond_layers they are held fixed
            if i + 1 < len(self.blocks) and i < self.cond_layers:
                x = blk(x, mod, mask)
        return cache

    def step_modulation(self, t: torch.Tensor) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Timestep conditioning of the action tokens for a sampling schedule, computed in one pass.

        t: (S,) int timesteps -> per timestep (block modulations [(1, 1, 6D)] * n_layers, final (1, 1, 2D)),
        the ``modulation`` argument of ``denoise`` (the same t for the whole batch).
        """
        ct = self.timestep_conditioning(t)  # (S, D)
        blocks = [blk.modulation(ct)[:, None, None].unbind(0) for blk in self.blocks]
        final = self.final_ada(ct)[:, None, None].unbind(0)
        return [([b[i] for b in blocks], final[i]) for i in range(len(t))]

    def denoise(self, noisy, t, cache, modulation=None):
        """One denoising step on the action tokens only.

        Args:
            noisy: (B, horizon, A) noisy normalized actions. t: (B,) or () int timestep.
            cache: ``condition(obs_tokens, prefix)`` (batch B or 1).
            modulation: ``step_modulation(...)[i]`` for this t (optional; computed from t when None).
        Returns:
            as ``forward``: (prediction (B, horizon, A), action hidden states (B, horizon / P, D)).
        """
        B = noisy.shape[0]
        if modulation is None:
            t = t.expand(B) if t.ndim else t.reshape(1).expand(B)
            ct = self.timestep_conditioning(t)
            modulation = [blk.modulation(ct).unsqueeze(1) for blk in self.blocks], self.final_ada(ct).unsqueeze(1)
        mods, final = modulation
        x = self._action_tokens(noisy)
        for blk, mod, kv in zip(self.blocks, mods, cache):
            x = blk(x, mod, None, past_kv=kv)  # action rows of the mask are all True: no mask
        return self._head(x, final)


class ChunkGraph(nn.Module):
    """``AEDDiffusionPolicy.chunk_graph``'s module: ``forward(noise, *inputs)`` -> raw actions (B, horizon, A),
    DDIM at a fixed step count (``policies.onnx`` traces it)."""

    def __init__(self, policy: nn.Module, steps: int, names: list[str]):
        super().__init__()
        self.policy, self.steps, self.names = policy, steps, names

    def forward(self, noise: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        batch = dict(zip(self.names, inputs))
        obs, prefix = self.policy._conditioning(batch)
        return self.policy._denoise_chunk(obs, prefix, noise, self.steps)


class MTDecoder(nn.Module):
    """Motion-aware transition decoder: (query (B, D), span k (B,), hidden (B, horizon / P, D), key mask (B, horizon / P))
    -> (B, F) predicted feature change."""

    def __init__(self, cfg: AEDDiffusionConfig, feat_dim: int):
        super().__init__()
        S = cfg.horizon // cfg.aed.group_size
        self.span_emb = nn.Embedding(S + 1, cfg.dim)
        self.blocks = nn.ModuleList(CrossBlock(cfg.dim, cfg.n_heads, cfg.mlp_ratio, cfg.dropout, self_attn=False)
                                    for _ in range(cfg.mt_loss.decoder_layers))
        self.out = nn.Sequential(nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, feat_dim))

    def forward(self, query, k, hidden, key_mask):
        x = (query + self.span_emb(k)).unsqueeze(1)
        for blk in self.blocks:
            x = blk(x, hidden, key_mask)
        return self.out(x[:, 0])


# ----------------------------------------------------------------------------- the policy
def action_clip_range(stats: dict, mode: str, given: float | None) -> float:
    """The diffusion schedulers' ``clip_sample_range`` (normalized units) consistent with the action statistics.

    ``min_max`` maps the data to [-1, 1], so the extent is 1.0; ``mean_std`` standardizes, so the extent is the
    largest ``|min - mean| / std`` or ``|max - mean| / std`` over the action dimensions (a dimension with zero std
    counts 0). ``given=None`` returns the extent; a given range is returned if it covers the extent.

    Args:
        stats: the action statistics ``{"min", "max", "mean", "std"}`` (per-dimension lists).
        mode: ``"min_max"`` or ``"mean_std"``.
        given: ``config.clip_sample_range``.
    Raises:
        ValueError: ``mean_std`` statistics without min/max; a given range that would clip actions the data holds
            (e.g. the old default 1.0 with mean_std: nothing beyond mean + 1 std could be sampled).
    """
    if mode == "min_max":
        extent = 1.0
    else:
        if "min" not in stats or "max" not in stats:
            raise ValueError("clip_sample with action_norm=mean_std needs the action min/max statistics to derive "
                             "clip_sample_range (or set clip_sample=false)")
        mean, std = np.asarray(stats["mean"], np.float64), np.asarray(stats["std"], np.float64)
        lo, hi = np.asarray(stats["min"], np.float64), np.asarray(stats["max"], np.float64)
        ok = std >= 1e-6
        z = np.maximum(np.abs(lo - mean), np.abs(hi - mean)) / np.where(ok, std, 1.0)
        extent = float(np.max(np.where(ok, z, 0.0), initial=0.0))
        extent = max(extent, 1e-3)
    if given is None:
        return extent
    if not float(given) >= extent - 1e-6:
        raise ValueError(f"clip_sample_range={given} clips actions the data holds: action_norm={mode} puts them up "
                         f"to {extent:.3f} normalized units from the centre; use null (derived) or >= {extent:.3f}")
    return float(given)


class AEDDiffusionPolicy(PreTrainedPolicy):
    """AED-conditioned diffusion policy (see module docstring).

    Args:
        config: ``AEDDiffusionConfig``.
        stats: store statistics ``{key: {"min", "max", "mean", "std", ...}}`` for every state key and "action".
        tokenizer: fitted ``ActionTokenizer`` (required when ``config.aed.enabled``), with
            ``r == config.aed.group_size`` and ``action_dim == config.action_dim``.
    Raises:
        ValueError: missing tokenizer or stats, or a tokenizer that disagrees with the config.
    """

    name = "aed_diffusion"
    denoising = True   # samples chunks from noise: takes the sampling keywords of policies.base.Policy
    REQUIRED_FILES = (CONFIG_NAME, WEIGHTS_NAME, STATS_NAME)

    def __init__(self, config: AEDDiffusionConfig, stats: dict, tokenizer: ActionTokenizer | None = None):
        super().__init__()
        cfg = self.config = config
        if cfg.aed.enabled:
            if tokenizer is None:
                raise ValueError("aed.enabled=True needs a fitted ActionTokenizer (tokenizer=None given)")
            if tokenizer.r != cfg.aed.group_size or tokenizer.action_dim != cfg.action_dim:
                raise ValueError(f"tokenizer (r={tokenizer.r}, action_dim={tokenizer.action_dim}) disagrees with "
                                 f"config (aed.group_size={cfg.aed.group_size}, action_dim={cfg.action_dim})")
        self.tokenizer = tokenizer if cfg.aed.enabled else None
        keys = cfg.normalized_keys + ["action"]
        missing = [k for k in keys if k not in stats]
        if missing:
            raise ValueError(f"stats lack keys {missing} (have {sorted(stats)})")
        self.stats = {k: {s: np.asarray(v, dtype=np.float64).reshape(-1).tolist() for s, v in stats[k].items()
                          if s in ("min", "max", "mean", "std", "q01", "q99")} for k in keys}
        modes = {k: cfg.state_norm for k in cfg.normalized_keys} | {"action": cfg.action_norm}
        dims = ({k: cfg.input_shapes[k][0] for k in cfg.state_keys} | {k: 3 for k in cfg.point_keys}
                | {"action": cfg.action_dim})
        self.normalizer = Normalizer(self.stats, modes, dims)

        self.obs_encoder = ObsEncoder(cfg)
        K = self.obs_encoder.tokens_per_frame
        self.obs_frame_emb = nn.Parameter(torch.randn(cfg.n_obs_steps, 1, cfg.dim) * 0.02)
        G = cfg.num_groups if cfg.aed.enabled else 0
        if cfg.aed.enabled:
            self.aed = ActionExperienceDictionary(tokenizer.vocab_size, cfg.dim, G, tokenizer.max_tokens_per_group,
                                                  token_dim=cfg.aed.token_dim, pooling=cfg.aed.pooling)
            self.hist_frame_emb = nn.Parameter(torch.randn(G + 1, 1, cfg.dim) * 0.02)
            self.memory_queries = nn.Parameter(torch.randn(cfg.aed.memory_queries, cfg.dim) * 0.02)
            self.memory = nn.ModuleList(CrossBlock(cfg.dim, cfg.n_heads, cfg.mlp_ratio, cfg.dropout, self_attn=True)
                                        for _ in range(cfg.aed.memory_layers))
            self.prefix_block = CrossBlock(cfg.dim, cfg.n_heads, cfg.mlp_ratio, cfg.dropout, self_attn=False)
        self.denoiser = Denoiser(cfg, cfg.n_obs_steps * K, G)
        if cfg.mt_loss.weight > 0:
            self.mt_features = FrozenFeatures(cfg)
            self.mt_decoder = MTDecoder(cfg, self.mt_features.dim)
        self.clip_sample_range = (action_clip_range(self.stats["action"], cfg.action_norm, cfg.clip_sample_range)
                                  if cfg.clip_sample else float(cfg.clip_sample_range or 1.0))
        sched = {"num_train_timesteps": cfg.num_train_timesteps, "beta_schedule": cfg.beta_schedule,
                     "clip_sample": cfg.clip_sample, "clip_sample_range": self.clip_sample_range,
                     "prediction_type": cfg.prediction_type}
        self.noise_scheduler = DDPMScheduler(**sched)
        self.inference_scheduler = DDIMScheduler(**sched, set_alpha_to_one=True, steps_offset=0)
        # select_action's chunk function when set (policies.runtime's ONNX backend); else predict_action_chunk
        self.chunk_sampler = None
        self.reset()

    # ------------------------------------------------------------------ windows and preprocessing
    def window_spec(self) -> dict[str, tuple[str, list[int]]]:
        """Named windows the sampler must produce: ``{name: (store key, offsets from the anchor step)}``."""
        cfg = self.config
        spec = {k: (k, list(range(1 - cfg.n_obs_steps, 1))) for k in cfg.input_shapes}
        spec["action"] = ("action", list(range(cfg.horizon)))
        if cfg.aed.enabled:
            H, r = cfg.aed.history_actions, cfg.aed.group_size
            spec["history.action"] = ("action", list(range(-H, 0)))
            for k in cfg.input_shapes:
                spec[f"history.{k}"] = (k, list(range(-H, 1, r)))
        if cfg.mt_loss.weight > 0:
            for k in cfg.input_shapes:
                spec[f"future.{k}"] = (k, list(range(0, cfg.horizon + 1, cfg.aed.group_size)))
        return spec

    def inference_window_spec(self) -> dict[str, tuple[str, list[int]]]:
        """The windows ``predict_action_chunk`` needs (``window_spec`` without targets and future frames)."""
        return {n: v for n, v in self.window_spec().items() if n != "action" and not n.startswith("future.")}

    def tokenize_history(self, batch: dict) -> dict:
        """CPU preprocessor: add ``history.tokens``, ``history.token_mask``, ``history.group_mask`` (numpy ->
        torch, on the CPU) from ``history.action`` (B, H, A) and ``history.action_is_pad`` (B, H). No-op when the
        AED is off or the tokens are already there."""
        if self.tokenizer is None or "history.tokens" in batch:
            return batch
        if "history.action" not in batch:
            raise ValueError("batch lacks 'history.action' (B, H, action_dim) needed by the AED")
        a = batch["history.action"]
        pad = batch.get("history.action_is_pad")
        a = a.detach().cpu().numpy() if torch.is_tensor(a) else np.asarray(a)
        pad = None if pad is None else (pad.detach().cpu().numpy() if torch.is_tensor(pad) else np.asarray(pad))
        if a.shape[1] != self.config.aed.history_actions:
            raise ValueError(f"history.action: expected H={self.config.aed.history_actions} steps, given {a.shape}")
        out = self.tokenizer.encode_history(a, pad)
        batch = dict(batch)
        batch["history.tokens"] = torch.from_numpy(out["tokens"])
        batch["history.token_mask"] = torch.from_numpy(out["token_mask"])
        batch["history.group_mask"] = torch.from_numpy(out["group_mask"])
        return batch

    @property
    def device(self) -> torch.device:
        return self.denoiser.act_pos.device

    def _to_device(self, batch: dict) -> dict:
        dev = self.device
        out = {}
        for k, v in batch.items():
            if isinstance(v, np.ndarray) and v.dtype != object:
                v = torch.from_numpy(v)
            out[k] = v.to(dev, non_blocking=True) if torch.is_tensor(v) else v
        return out

    def _frames(self, batch: dict, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {}
        for k in self.config.input_shapes:
            name = prefix + k
            if name not in batch:
                raise ValueError(f"batch lacks {name!r} (window_spec() lists what the policy needs)")
            x = batch[name]
            if k.startswith("observation.images."):
                out[k] = normalize_image(x)
            elif k in self.config.point_keys:
                out[k] = self.point_input(k, x, batch.get(prefix + "observation.state"),
                                          batch.get(prefix + POINT_COLORS))
            elif k == POINT_COLORS:   # read with its point cloud by the point encoder
                continue
            else:
                out[k] = self.normalizer.normalize(k, x.float())
        return out

    def point_input(self, key: str, cloud: torch.Tensor, state: torch.Tensor | None,
                    colors: torch.Tensor | None = None) -> torch.Tensor:
        """The point encoder's input: (..., N, 3) raw cloud (metres) -> (..., N, ``point_in_dim``): coordinates
        normalised per axis; with ``point_relative`` also each point's offset from the hand (``state`` (..., 4) raw
        ``observation.state``, its first three entries the hand's position in the cloud's frame) in the same scale;
        with ``point_color`` also each point's colour (``colors`` (..., N, 3) uint8 RGB) in [-1, 1].

        Raises:
            ValueError: ``point_relative`` without ``observation.state``, ``point_color`` without the colours."""
        if self.config.point_relative and state is None:
            raise ValueError("point_relative: the batch lacks 'observation.state' (the hand's position)")
        if self.config.point_color and colors is None:
            raise ValueError(f"point colours: the batch lacks {POINT_COLORS!r}")
        centre, half = self.normalizer._ab(key)
        return point_features(cloud, centre, half, state[..., :3] if self.config.point_relative else None,
                              colors if self.config.point_color else None)

    # ------------------------------------------------------------------ conditioning
    def _conditioning(self, batch: dict):
        """-> obs tokens (B, n_obs*K, D), prefix (B, G, D) or None."""
        n, keys = self.config.n_obs_steps, list(self.config.input_shapes)
        if self.config.aed.enabled:  # current and history frames through the encoder in one call; the history's
            # last frame (offset 0) is the current window's last frame, so it is encoded once
            for k in keys:
                if f"history.{k}" not in batch:
                    raise ValueError(f"batch lacks 'history.{k}' (window_spec() lists what the policy needs)")
            batch = {**batch, **{k: torch.cat([batch[k], batch[f"history.{k}"][:, :-1]], 1) for k in keys if k in batch}}
        tok = self.obs_encoder(self._frames(batch))  # (B, n_obs [+ G], K, D)
        obs = (tok[:, :n] + self.obs_frame_emb).flatten(1, 2)
        if not self.config.aed.enabled:
            return obs, None
        hist = torch.cat([tok[:, n:], tok[:, n - 1:n]], 1) + self.hist_frame_emb  # (B, G+1, K, D)
        B, T, K, D = hist.shape
        pad_key = f"history.{keys[0]}_is_pad"
        valid = ~batch[pad_key].bool() if pad_key in batch else torch.ones(B, T, dtype=torch.bool, device=hist.device)
        valid = valid[:, :, None].expand(B, T, K).reshape(B, T * K)
        mem = self.memory_queries.expand(B, -1, -1)
        ctx = hist.reshape(B, T * K, D)
        for blk in self.memory:
            mem = blk(mem, ctx, valid)
        groups = self.aed(batch["history.tokens"], batch["history.token_mask"].bool(),
                          batch["history.group_mask"].bool())
        return obs, self.prefix_block(groups, mem)

    # ------------------------------------------------------------------ training
    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """Training loss on a collated ``WindowDataset`` batch.

        Optional batch keys: ``sample_weight`` (B,) float weights of each window's diffusion loss (weighted
        mean); with ``config.mask_action_padding`` actions flagged in ``action_is_pad`` are left out.

        Returns:
            loss: scalar tensor = diffusion MSE + ``mt_loss.weight`` * MT loss.
            metrics: {"loss", "diffusion_loss", "mt_loss"} floats.
        """
        cfg = self.config
        batch = self._to_device(self.tokenize_history(batch))
        obs, prefix = self._conditioning(batch)
        actions = self.normalizer.normalize("action", batch["action"].float())
        B = actions.shape[0]
        noise = torch.randn_like(actions)
        t = torch.randint(0, cfg.num_train_timesteps, (B,), device=actions.device)
        noisy = self.noise_scheduler.add_noise(actions, noise, t)
        pred, hidden = self.denoiser(noisy, t, obs, prefix)
        target = noise if cfg.prediction_type == "epsilon" else actions
        err = F.mse_loss(pred.float(), target, reduction="none")
        keep = torch.ones_like(err)
        if cfg.mask_action_padding and "action_is_pad" in batch:
            keep = keep * (~batch["action_is_pad"].bool()).unsqueeze(-1).to(err.dtype)
        if "sample_weight" in batch:  # optional per-window weights (e.g. FERT retrieval similarity)
            keep = keep * batch["sample_weight"].to(err.dtype).view(B, 1, 1)
        diff_loss = (err * keep).sum() / keep.sum().clamp_min(1e-8)
        loss, metrics = diff_loss, {"diffusion_loss": diff_loss.detach()}
        if cfg.mt_loss.weight > 0:
            mt = self._mt_loss(batch, hidden)
            loss = loss + cfg.mt_loss.weight * mt
            metrics["mt_loss"] = mt.detach()
        metrics["loss"] = loss.detach()
        return loss, {k: float(v) for k, v in metrics.items()}

    def _mt_loss(self, batch: dict, hidden: torch.Tensor) -> torch.Tensor:
        cfg, r = self.config, self.config.aed.group_size
        S = cfg.horizon // r
        B, dev = hidden.shape[0], hidden.device
        s = torch.randint(0, S, (B,), device=dev)
        k = (torch.rand(B, device=dev) * (S - s)).long().clamp_min(0) + 1  # k in [1, S - s]
        ar = torch.arange(B, device=dev)
        # only the span's two frames, s and s + k, of the S + 1 future frames go through f and the encoder
        ends = torch.stack([s, s + k], 1)  # (B, 2)
        frames = self._frames({f"future.{key}": batch[f"future.{key}"][ar[:, None], ends]
                               for key in cfg.input_shapes if f"future.{key}" in batch}, "future.")
        feats = self.mt_features(frames)  # (B, 2, F)
        target = feats[:, 1] - feats[:, 0]
        query = self.obs_encoder({key: x[:, :1] for key, x in frames.items()})[:, 0].mean(1)  # (B, D), frame s
        P = cfg.action_patch  # action token j holds actions [j * P, (j + 1) * P): keep those overlapping the span
        start = torch.arange(0, cfg.horizon, P, device=dev)
        key_mask = (start[None] + P > (s * r)[:, None]) & (start[None] < ((s + k) * r)[:, None])
        pred = self.mt_decoder(query, k, hidden, key_mask)
        pad_key = f"future.{next(iter(cfg.input_shapes))}_is_pad"
        valid = target.norm(dim=-1) > 1e-6
        if pad_key in batch:
            valid &= ~batch[pad_key].bool()[ar, s + k]
        per = F.mse_loss(F.normalize(pred.float(), dim=-1), F.normalize(target, dim=-1), reduction="none").mean(-1)
        return (per * valid).sum() / valid.sum().clamp_min(1)

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def predict_action_chunk(self, batch: dict, noise: torch.Tensor | None = None,
                             generator: torch.Generator | None = None,
                             num_inference_steps: int | None = None, use_cache: bool = True,
                             noise_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """Sample an action chunk with DDIM.

        The observation tokens, visual memory and AED prefix are computed once per chunk; with ``use_cache``
        (default) so are the denoiser's hidden states of those tokens (``Denoiser.condition``: they see
        neither the noisy actions nor the timestep), and each DDIM step runs the action tokens only.
        ``use_cache=False`` runs the whole masked sequence every step (``Denoiser.forward_masked``; the same
        result up to float rounding).

        Args:
            batch: the windows of ``inference_window_spec()`` (collated, leading batch dim B).
            noise: (B, horizon, action_dim) initial noise (default: ``torch.randn`` with ``generator``).
            num_inference_steps: DDIM steps (default ``config.num_inference_steps``), 1..num_train_timesteps.
            noise_scale: temperature of the initial noise: a float, or a (B,) tensor (one per row); the
                sampler starts from ``noise * noise_scale``. 1.0 is the trained sampler; > 1 draws chunks
                farther from the policy's usual mode while every chunk is still the denoiser's own output
                (modal-level exploration in the spirit of SIME, "Enhancing Policy Self-Improvement with
                Modal-level Exploration", 2025; used by ``fleet.worker.Exploration``).
        Returns:
            (B, horizon, action_dim) float32 actions in raw (unnormalized) units.
        Raises:
            ValueError: a missing window, noise of the wrong shape, a negative / non-finite noise_scale, or a
            step count outside 1..num_train_timesteps (:meth:`inference_steps`).
        """
        steps = self.inference_steps(num_inference_steps)
        batch = self._to_device(self.tokenize_history(batch))
        obs, prefix = self._conditioning(batch)
        x = self.initial_noise(obs.shape[0], noise, generator, noise_scale).to(obs.dtype)
        return self._denoise_chunk(obs, prefix, x, steps, use_cache)

    def inference_steps(self, num_inference_steps: int | None = None) -> int:
        """The DDIM step count to run: ``config.num_inference_steps`` for None, else ``num_inference_steps``
        checked to be an integer in 1..``config.num_train_timesteps``.

        Raises:
            ValueError: out of range or not an integer. 0 steps would silently run the default and a negative
            count would return the initial noise as the action chunk (on a robot, a safety matter).
        """
        if num_inference_steps is None:
            return int(self.config.num_inference_steps)
        T = int(self.config.num_train_timesteps)
        if isinstance(num_inference_steps, bool) or int(num_inference_steps) != num_inference_steps \
                or not 1 <= int(num_inference_steps) <= T:
            raise ValueError(f"num_inference_steps: expected an integer in 1..{T} (num_train_timesteps), "
                             f"given {num_inference_steps!r}")
        return int(num_inference_steps)

    def initial_noise(self, B: int, noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
                      noise_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """The sampler's starting point (B, horizon, action_dim) float32 on the policy's device: ``noise`` (or
        ``torch.randn`` with ``generator``) times ``noise_scale`` (a float or one per row).

        Raises:
            ValueError: noise of the wrong shape, or a negative / non-finite noise_scale.
        """
        shape = (B, self.config.horizon, self.config.action_dim)
        if noise is None:
            noise = torch.randn(shape, generator=generator, device=generator.device if generator else self.device)
        if tuple(noise.shape) != shape:
            raise ValueError(f"noise: expected shape {shape}, given {tuple(noise.shape)}")
        scale = torch.as_tensor(noise_scale, dtype=torch.float32)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()) or scale.numel() not in (1, B):
            raise ValueError(f"noise_scale: expected a finite value >= 0 (or one per batch row, B={B}), given "
                             f"{noise_scale}")
        x = noise.to(self.device, torch.float32)
        if scale.numel() != 1 or float(scale) != 1.0:
            x = x * scale.to(self.device).reshape(-1, 1, 1)
        return x

    def _denoise_chunk(self, obs: torch.Tensor, prefix: torch.Tensor | None, x: torch.Tensor, steps: int,
                       use_cache: bool = True) -> torch.Tensor:
        """DDIM from the initial noise x (B, horizon, A) to raw actions, given the conditioning (``_conditioning``).
        Tensor ops only (the step count is a Python int): ``ChunkGraph`` traces it for the ONNX export."""
        sched = self.inference_scheduler
        sched.set_timesteps(steps)
        if use_cache:
            cache = self.denoiser.condition(obs, prefix)
            mods = self.denoiser.step_modulation(sched.timesteps.to(self.device))
        for i, t in enumerate(sched.timesteps):
            if use_cache:
                out = self.denoiser.denoise(x, t, cache, mods[i])[0]
            else:
                out = self.denoiser.forward_masked(x, t.to(self.device), obs, prefix)[0]
            x = sched.step(out.float(), t, x.float()).prev_sample.to(obs.dtype)
        return self.normalizer.unnormalize("action", x.float())

    def chunk_graph(self, num_inference_steps: int) -> tuple[nn.Module, list[str]]:
        """The whole action-chunk sampler at a fixed DDIM step count as a tensors-in, tensors-out module, for
        ``policies.onnx.export_onnx`` (tracing).

        Returns:
            (module, input names): ``module(noise (B, horizon, A) float32, *inputs)`` -> (B, horizon, A) float32
            raw actions, where ``inputs`` are the tensors named by ``input names`` in that order: the
            inference windows after ``tokenize_history`` (the action history's BPE tokens are computed outside
            the graph, by HF ``tokenizers``). The same code as ``predict_action_chunk`` (``_denoise_chunk``).
        """
        names = sorted(self.inference_window_spec())
        names = sorted(set(names) | {f"{n}_is_pad" for n in names})
        if self.tokenizer is not None:
            names = sorted(set(names) | {"history.tokens", "history.token_mask", "history.group_mask"})
        return ChunkGraph(self, int(num_inference_steps), names), names

    def reset(self):
        """Clear the deployment history and action queue (call at every episode start)."""
        from policies.history import WindowHistory

        super().reset()
        self.history = WindowHistory(self.inference_window_spec(), self.config.action_dim)

    @torch.no_grad()
    def select_action(self, obs: dict, generator: torch.Generator | None = None,
                      generators: list[torch.Generator] | None = None, noise_scale: float = 1.0):
        """One control step at deployment.

        Keeps the last observations and executed actions in ``self.history`` (``policies.history.WindowHistory``,
        the same windows the sampler builds: edge-repeated frames and ``_is_pad`` flags before the episode
        start), predicts a chunk when the queue is empty and queues its first ``n_action_steps`` actions.

        Args:
            obs: {feature name: (B, ...) tensor} batched, or {name: np.ndarray} of one unbatched observation.
            generator: one generator for the batch's initial denoising noise; or ``generators``: one per batch
                row, so each row's noise depends on its own generator only (a batched evaluation then acts
                like one episode at a time, whatever else is in the batch).
            noise_scale: temperature of the initial denoising noise (``predict_action_chunk``; 1.0: as trained).
        Returns:
            (B, action_dim) float32 tensor, or a (action_dim,) float32 numpy array for unbatched numpy input.
        """
        unbatched = all(isinstance(v, np.ndarray) for v in obs.values())
        cur = {}
        for k, shape in self.config.input_shapes.items():
            if k not in obs:
                raise ValueError(f"observation lacks {k!r}")
            x = torch.as_tensor(np.asarray(obs[k]) if unbatched else obs[k])
            if unbatched:
                x = x.unsqueeze(0)
            if list(x.shape[1:]) != list(shape):
                raise ValueError(f"observation {k!r}: expected (B, {', '.join(map(str, shape))}), given {tuple(x.shape)}")
            cur[k] = x
        self.history.push_obs(cur)

        def chunk() -> torch.Tensor:
            noise = None
            if generators is not None:
                B = next(iter(cur.values())).shape[0]
                if len(generators) != B:
                    raise ValueError(f"generators: expected {B} (one per batch row), given {len(generators)}")
                shape = (self.config.horizon, self.config.action_dim)
                noise = torch.stack([torch.randn(shape, generator=g, device=g.device) for g in generators])
            out = (self.chunk_sampler or self.predict_action_chunk)(self.history.batch(), noise=noise,
                                                                    generator=generator, noise_scale=noise_scale)
            return out[:, : self.config.n_action_steps].cpu()

        a = self._next_action(chunk)
        self.history.push_action(a)
        return a[0].numpy().astype(np.float32) if unbatched else a

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def build(cls, cfg: dict, reader, episodes) -> AEDDiffusionPolicy:
        """A fresh policy for the Hydra ``policy`` node ``cfg`` (configs/policy/aed_diffusion*.yaml): input
        shapes from the store, the action tokenizer (AED on) and normalisation statistics fitted on
        ``episodes`` (:func:`config_from_hydra` and :func:`build_policy`).

        Raises:
            ValueError: a bad config value or an input key the store lacks.
        """
        return build_policy(config_from_hydra(cfg, reader), reader, episodes)

    def _save_extra(self, directory: Path) -> None:
        """``tokenizer.json`` (AED on): the action tokenizer the history tokens come from."""
        if self.tokenizer is not None:
            self.tokenizer.save(directory / TOKENIZER_NAME)

    @classmethod
    def _from_saved(cls, directory: Path, cfg: dict, stats: dict | None) -> AEDDiffusionPolicy:
        """The untrained policy of a checkpoint (``from_pretrained``: files, type and weights are checked there).

        A ``config.json`` saved before a config field existed is migrated: the field gets the value of those
        checkpoints (``configuration_aed_diffusion.CHECKPOINT_MIGRATION``: ``action_patch`` 1, ``condition_layers``
        None), not the dataclass default.
        """
        config = AEDDiffusionConfig.from_dict(migrate_checkpoint_config(cfg))  # fields it predates: their old values
        tok = ActionTokenizer.load(directory / TOKENIZER_NAME) if config.aed.enabled else None
        return cls(config, stats, tok)

    def compile_for_inference(self) -> None:
        """Compile the denoising step (``Denoiser.denoise``, the per-DDIM-step work) with ``torch.compile``
        (inductor; static shapes): one small fused kernel set instead of ~25 small ops per block, the same
        actions up to float rounding. The first chunk pays the compilation (tens of seconds on a CPU); a new
        batch size compiles again. Used by ``PolicyRuntime(compile=True)``."""
        self.denoiser.denoise = torch.compile(self.denoiser.denoise, dynamic=False)

    def compile_modules(self) -> list[nn.Module]:
        """The submodules ``train.compile`` compiles (``torch.compile``): the denoiser and the observation encoder."""
        return [self.denoiser, self.obs_encoder]

    def num_parameters(self) -> int:
        """Learned parameters (the frozen MT-target extractor excluded)."""
        frozen = {id(p) for p in self.mt_features.parameters()} if hasattr(self, "mt_features") else set()
        return sum(p.numel() for p in self.parameters() if id(p) not in frozen)


# building a fresh policy from its Hydra config and a store (the training script, policies.factory and
# AEDDiffusionPolicy.build call these)

def input_shapes_from_store(reader, keys: list[str] | None = None) -> dict[str, list[int]]:
    """Per-frame shapes of the store's observation keys (``reader.features``); ``keys`` selects (and orders).

    Raises:
        ValueError: a requested key the store does not hold.
    """
    feats = {k: list(v["shape"]) for k, v in reader.features.items() if k.startswith("observation.")}
    if keys is None:
        return feats
    missing = [k for k in keys if k not in feats]
    if missing:
        raise ValueError(f"store {getattr(reader, 'url', '')} lacks observation keys {missing} (has {sorted(feats)})")
    return {k: feats[k] for k in keys}


def config_from_hydra(pcfg: dict, reader) -> AEDDiffusionConfig:
    """Hydra ``policy`` node (configs/policy/aed_diffusion*.yaml) + the store's feature shapes ->
    ``AEDDiffusionConfig``. ``input_keys`` null: every non-image ``observation.*`` key of the store (image keys
    too with ``images: true``).

    Raises:
        ValueError: an input key the store lacks, or a bad config value (from ``AEDDiffusionConfig``).
    """
    pcfg = dict(pcfg)
    keys, images = pcfg.pop("input_keys", None), pcfg.pop("images", False)
    if keys is None:
        keys = [k for k, v in reader.features.items() if k.startswith("observation.")
                and (images or len(v["shape"]) != 3)]
    return AEDDiffusionConfig.from_dict({**pcfg, "input_shapes": input_shapes_from_store(reader, list(keys))})


def build_policy(policy_cfg: AEDDiffusionConfig, reader, episodes) -> AEDDiffusionPolicy:
    """Fit the action tokenizer on ``episodes``' actions (AED on), take stats over ``episodes`` and build
    a fresh policy."""
    stats = reader.stats(policy_cfg.normalized_keys + ["action"], episodes=episodes)
    tok = None
    if policy_cfg.aed.enabled:
        acts = [reader.load_episode(e.episode_id, keys=["action"])["action"] for e in episodes]
        tok = ActionTokenizer.fit(acts, r=policy_cfg.aed.group_size, relative_dims=policy_cfg.relative_action_dims,
                                  absolute_dims=policy_cfg.absolute_action_dims, scale=policy_cfg.aed.tokenizer_scale,
                                  vocab_size=policy_cfg.aed.tokenizer_vocab_size)
    return AEDDiffusionPolicy(policy_cfg, stats, tok)
