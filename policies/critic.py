"""Success critic: value-guided selection among sampled action chunks, learned from the fleet's successes AND failures.

Imitation (filtered BC, FERT's retrieval) can only use the fleet's successes; a failure says nothing to it. A
critic can use both: ``SuccessCritic`` estimates, from the state and a candidate action chunk, the discounted
probability that the episode succeeds (a Monte-Carlo value of the fleet's behaviour, fitted by
``fleet.fert.critic_fit.fit_critic`` on every committed episode of the store, retries included). At deployment the policy samples
``candidates`` chunks from its own denoiser (different initial noise) and executes the one the critic ranks
highest (:class:`CriticGuidedSampler`). Every executed chunk is still the diffusion policy's own output; the
critic only chooses among them. This is value-guided policy steering (V-GPS: Nakamoto et al., "Steering Your
Generalists: Improving Robotic Foundation Models via Value Guidance", CoRL 2024), here with a Monte-Carlo
success target instead of their Cal-QL critic.

Files (beside the policy's own in a checkpoint directory): ``critic.safetensors`` (weights and input
standardisation) and ``critic.json`` (shapes and the recipe). :func:`load_critic` returns None for a checkpoint
without them; ``fleet.acting.load_checkpoint`` installs a found critic on the policy it loads.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from policies.features import POINT_COLORS, point_in_dim

CRITIC_WEIGHTS = "critic.safetensors"
CRITIC_CONFIG = "critic.json"
CRITIC_FILES = (CRITIC_WEIGHTS, CRITIC_CONFIG)


class CriticFeatures(nn.Module):
    """What the critic sees of one frame: the raw state vectors of ``state_keys`` concatenated with, per camera of
    ``image_keys``, a frozen image encoder's features average-pooled to one vector.

    The image encoder is a copy of the policy's own (``policies.aed_diffusion.modeling_aed_diffusion.ImageEncoder``
    with ``image_channels``; :meth:`from_policy`), frozen when copied, so the critic's inputs stay fixed while the
    policy it ships with is fine-tuned. A real arm has proprioception and cameras, not object positions: with the
    policy's inputs ``observation.state`` + a camera, the critic scores exactly what the robot observes.

    forward(frames: ``{key: (N, d)`` float | ``(N, H, W, 3)`` uint8 (or float 0..255)``}``) -> (N, D) float32 on the
    CPU (the frames may sit on any device; the encoders run on theirs), ``D = sum(d) + len(image_keys) *
    image_channels[-1]``.

    Raises:
        ValueError: image keys without ``image_channels``, or a frame dict lacking a key (named).
    """

    def __init__(self, state_keys: Sequence[str] = (), image_keys: Sequence[str] = (),
                 image_channels: Sequence[int] | None = None, point_keys: Sequence[str] = (),
                 point_channels: Sequence[int] | None = None, point_dim: int | None = None,
                 point_relative: bool = False, point_color: bool = False):
        super().__init__()
        self.state_keys, self.image_keys = list(state_keys), list(image_keys)
        self.point_relative, self.point_color = bool(point_relative), bool(point_color)
        self.image_channels = [int(c) for c in image_channels] if image_channels else None
        if self.image_keys and not self.image_channels:
            raise ValueError(f"CriticFeatures: image keys {self.image_keys} need the encoder's image_channels")
        self.point_keys = list(point_keys)
        self.point_channels = [int(c) for c in point_channels] if point_channels else None
        self.point_dim = int(point_dim) if point_dim else None
        if self.point_keys and not (self.point_channels and self.point_dim):
            raise ValueError(f"CriticFeatures: point keys {self.point_keys} need the encoder's point_channels and dim")
        self.images = nn.ModuleDict()
        if self.image_keys:
            from policies.aed_diffusion.modeling_aed_diffusion import ImageEncoder

            self.images = nn.ModuleDict({k.replace(".", "_"): ImageEncoder(self.image_channels, 1)
                                         for k in self.image_keys})
        self.points = nn.ModuleDict()
        if self.point_keys:
            from policies.aed_diffusion.modeling_aed_diffusion import PointEncoder

            pin = point_in_dim(self.point_relative, self.point_color)
            self.points = nn.ModuleDict({k.replace(".", "_"): PointEncoder(self.point_channels, self.point_dim, pin)
                                         for k in self.point_keys})
            for k in self.point_keys:   # the policy's coordinate normalisation, copied with its encoder
                self.register_buffer(f"{k.replace('.', '_')}_centre", torch.zeros(3))
                self.register_buffer(f"{k.replace('.', '_')}_half", torch.ones(3))
        self.requires_grad_(False)

    def spec(self) -> dict:
        """The keyword arguments that rebuild these features (``critic.json`` holds them)."""
        return {"state_keys": self.state_keys, "image_keys": self.image_keys, "image_channels": self.image_channels,
                "point_keys": self.point_keys, "point_channels": self.point_channels, "point_dim": self.point_dim,
                "point_relative": self.point_relative, "point_color": self.point_color}

    @property
    def keys(self) -> list[str]:
        """Every observation key read, state keys first."""
        return [*self.state_keys, *self.image_keys, *self.point_keys,
                *([POINT_COLORS] if self.point_keys and self.point_color else [])]

    def image_dim(self) -> int:
        """Feature width the cameras add (0 without cameras)."""
        return len(self.image_keys) * (self.image_channels[-1] if self.image_channels else 0)

    @classmethod
    def from_policy(cls, policy, images: bool = True) -> CriticFeatures:
        """The features for ``policy``: its 1-D inputs as state keys and, with ``images`` and a policy that encodes
        cameras or point clouds (an ``obs_encoder`` with ``images`` / ``points``), those keys through frozen copies
        of its encoders (a point cloud with the policy's coordinate normalisation)."""
        shapes = policy.config.input_shapes
        state = [k for k, shape in shapes.items() if len(shape) == 1]
        enc = getattr(getattr(policy, "obs_encoder", None), "images", None)
        penc = getattr(getattr(policy, "obs_encoder", None), "points", None)
        cams = [k for k, shape in shapes.items() if len(shape) == 3] if images and enc is not None else []
        pts = list(policy.config.point_keys) if images and penc is not None else []
        feats = cls(state, cams, list(policy.config.image_channels) if cams else None, pts,
                    list(policy.config.point_channels) if pts else None, int(policy.config.dim) if pts else None,
                    bool(getattr(policy.config, "point_relative", False)) if pts else False,
                    bool(getattr(policy.config, "point_color", False)) if pts else False)
        for k in cams:
            feats.images[k.replace(".", "_")].load_state_dict(enc[k.replace(".", "_")].state_dict())
        for k in pts:
            n = k.replace(".", "_")
            feats.points[n].load_state_dict(penc[n].state_dict())
            centre, half = policy.normalizer._ab(k)
            getattr(feats, f"{n}_centre").copy_(centre.detach().cpu())
            getattr(feats, f"{n}_half").copy_(half.detach().cpu())
        return feats.eval()

    @torch.no_grad()
    def forward(self, frames: dict) -> torch.Tensor:
        missing = [k for k in self.keys if k not in frames]
        if missing:
            raise ValueError(f"CriticFeatures: the frames lack {missing} (the critic reads {self.keys})")
        out = [torch.as_tensor(frames[k]).float().flatten(1).cpu() for k in self.state_keys]
        if self.image_keys:
            from policies.aed_diffusion.normalization import normalize_image

            dev = next(self.parameters()).device
            for k in self.image_keys:
                x = normalize_image(torch.as_tensor(frames[k]).to(dev))
                out.append(self.images[k.replace(".", "_")](x).flatten(1).float().cpu())
        if self.point_keys:
            from policies.aed_diffusion.modeling_aed_diffusion import point_features
        for k in self.point_keys:
            n = k.replace(".", "_")
            centre, half = getattr(self, f"{n}_centre"), getattr(self, f"{n}_half")
            hand = (torch.as_tensor(frames["observation.state"]).to(centre.device)[:, :3]
                    if self.point_relative else None)   # as the policy's point_input
            rgb = torch.as_tensor(frames[POINT_COLORS]).to(centre.device) if self.point_color else None
            x = point_features(torch.as_tensor(frames[k]).to(centre.device), centre, half, hand, rgb)
            out.append(self.points[n](x).float().cpu())
        return torch.cat(out, -1)



class SuccessCritic(nn.Module):
    """An ensemble of MLPs ``Q(s_t, s_t - s_{t-1}, a_{t:t+n}) -> logit of the discounted success``.

    Args:
        state_dim: D, the width of a frame's features (:class:`CriticFeatures`: the state keys' widths, plus the
            image features when ``image_keys`` are given).
        action_dim: A. chunk_steps: n, the executed steps of a chunk scored (the policy's ``n_action_steps``).
        members / hidden / dropout: ensemble size, hidden width (3 layers, LayerNorm, ReLU), dropout.
        state_keys: observation keys concatenated (in this order) into the state.
        image_keys / image_channels: cameras scored through frozen copies of the policy's image encoder
            (:class:`CriticFeatures`; ``frame`` holds them).
        point_keys / point_channels / point_dim: point clouds scored through frozen copies of the policy's point
            encoder (``point_dim`` its output width).

    Inputs are standardised with the ``mean`` / ``std`` buffers (set by :func:`fit_critic`).
    """

    def __init__(self, state_dim: int, action_dim: int, chunk_steps: int, members: int = 5, hidden: int = 256,
                 dropout: float = 0.2, state_keys: Sequence[str] = (), image_keys: Sequence[str] = (),
                 image_channels: Sequence[int] | None = None, point_keys: Sequence[str] = (),
                 point_channels: Sequence[int] | None = None, point_dim: int | None = None,
                 point_relative: bool = False, point_color: bool = False):
        super().__init__()
        if min(state_dim, action_dim, chunk_steps, members, hidden) < 1:
            raise ValueError(f"SuccessCritic: every size must be >= 1, given state_dim={state_dim}, action_dim="
                             f"{action_dim}, chunk_steps={chunk_steps}, members={members}, hidden={hidden}")
        self.state_dim, self.action_dim, self.chunk_steps = int(state_dim), int(action_dim), int(chunk_steps)
        self.members, self.hidden, self.dropout = int(members), int(hidden), float(dropout)
        self.state_keys = list(state_keys)
        self.frame = CriticFeatures(state_keys, image_keys, image_channels, point_keys, point_channels, point_dim,
                                    point_relative, point_color)
        self.image_keys, self.image_channels = self.frame.image_keys, self.frame.image_channels
        d_in = 2 * self.state_dim + self.chunk_steps * self.action_dim
        self.nets = nn.ModuleList([nn.Sequential(
            nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(self.dropout),
            nn.Linear(hidden, 1)) for _ in range(self.members)])
        self.register_buffer("mean", torch.zeros(d_in))
        self.register_buffer("std", torch.ones(d_in))

    def raw_features(self, state: torch.Tensor, prev_state: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """(B, D), (B, D), (B, >= n, A) raw units -> (B, 2D + nA) float32 inputs before standardisation."""
        if state.shape[-1] != self.state_dim or chunk.shape[-1] != self.action_dim or chunk.shape[1] < self.chunk_steps:
            raise ValueError(f"SuccessCritic: expected state (B, {self.state_dim}) and chunk (B, >={self.chunk_steps}, "
                             f"{self.action_dim}), given {tuple(state.shape)} and {tuple(chunk.shape)}")
        return torch.cat([state, state - prev_state, chunk[:, : self.chunk_steps].flatten(1)], -1).float()

    def features(self, state: torch.Tensor, prev_state: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """:meth:`raw_features` standardised with the ``mean`` / ``std`` buffers."""
        return (self.raw_features(state, prev_state, chunk) - self.mean) / self.std

    def forward(self, state: torch.Tensor, prev_state: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """(members, B) logits of the discounted success."""
        x = self.features(state, prev_state, chunk)
        return torch.stack([m(x).squeeze(-1) for m in self.nets])

    @torch.no_grad()
    def success_probability(self, state: torch.Tensor, prev_state: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """(B,) the ensemble's mean discounted success probability in [0, 1] (eval mode: no dropout)."""
        return torch.sigmoid(self.forward(state, prev_state, chunk)).mean(0)

    def config(self) -> dict:
        return {"state_dim": self.state_dim, "action_dim": self.action_dim, "chunk_steps": self.chunk_steps,
                "members": self.members, "hidden": self.hidden, "dropout": self.dropout,
                **self.frame.spec()}


def save_critic(critic: SuccessCritic, directory: str | Path, candidates: int) -> Path:
    """Write ``critic.safetensors`` and ``critic.json`` (shapes, ``candidates``) into ``directory``."""
    from safetensors.torch import save_file

    if int(candidates) < 1:
        raise ValueError(f"save_critic: candidates must be >= 1, given {candidates}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in critic.state_dict().items()}, str(d / CRITIC_WEIGHTS))
    (d / CRITIC_CONFIG).write_text(json.dumps({**critic.config(), "candidates": int(candidates),
                                               "source": "V-GPS (Nakamoto et al. 2024), Monte-Carlo success target"},
                                              indent=1))
    return d


def load_critic(directory: str | Path, device: str = "cpu") -> tuple[SuccessCritic, int] | None:
    """``(critic in eval mode, candidates)`` from a checkpoint directory, or None when it has no critic.

    Raises:
        ValueError: only one of the two files present, a malformed ``critic.json``, weights whose shapes do
            not match it, or non-finite weights (a diverged fit: it would rank every chunk NaN) (the message names
            the tensor).
    """
    from safetensors.torch import load_file

    d = Path(directory)
    have = [(d / f).is_file() for f in CRITIC_FILES]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"checkpoint {str(d)!r}: a critic needs both {CRITIC_FILES}; found only "
                         f"{[f for f, h in zip(CRITIC_FILES, have) if h]}")
    try:
        cfg = json.loads((d / CRITIC_CONFIG).read_text())
        critic = SuccessCritic(int(cfg["state_dim"]), int(cfg["action_dim"]), int(cfg["chunk_steps"]),
                               int(cfg["members"]), int(cfg["hidden"]), float(cfg["dropout"]), cfg["state_keys"],
                               cfg.get("image_keys") or (), cfg.get("image_channels"), cfg.get("point_keys") or (),
                               cfg.get("point_channels"), cfg.get("point_dim"), bool(cfg.get("point_relative", False)),
                               bool(cfg.get("point_color", False)))
        candidates = int(cfg["candidates"])
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {str(d)!r}: malformed {CRITIC_CONFIG}: {e}") from None
    state = load_file(str(d / CRITIC_WEIGHTS))
    own = critic.state_dict()
    bad = sorted(k for k in set(own) | set(state) if k not in state or k not in own or own[k].shape != state[k].shape)
    if bad:
        raise ValueError(f"checkpoint {str(d)!r}: {CRITIC_WEIGHTS} does not fit {CRITIC_CONFIG} (tensors {bad[:5]})")
    nonfinite = sorted(k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all())
    if nonfinite:
        raise ValueError(f"checkpoint {str(d)!r}: {CRITIC_WEIGHTS} holds non-finite values in {nonfinite[:5]} (a "
                         "diverged critic fit); the version cannot rank chunks")
    critic.load_state_dict(state)
    return critic.to(device).eval(), candidates


class CriticGuidedSampler:
    """The policy's ``chunk_sampler``: sample ``candidates`` chunks per batch row and return the one ``critic``
    ranks highest, (B, horizon, A).

    Candidate 0 starts from the row's own initial noise (what the policy alone would execute); the others from
    noise drawn by a generator seeded with a CRC32 of that noise, so a row's choice depends on its own noise only
    (a batched evaluation still acts like one episode at a time). The state the critic scores is the last two
    frames of the policy's observation window (``state_keys``).

    Args:
        policy: a policy with ``predict_action_chunk(batch, noise=, noise_scale=)`` and ``config.horizon``,
            ``config.action_dim``. critic: a :class:`SuccessCritic`, or None for a sampler that only draws the
            candidates (:meth:`candidate_chunks`; the critic's fit and the candidates' sampling then run side by
            side, ``policies.distill``). candidates: K >= 1 (1: the policy alone).
        inner: the chunk function to call (default ``policy.predict_action_chunk``; e.g. an ONNX runtime's).
        state_keys: the state vectors the critic scores (default: the critic's own ``state_keys``).
        features: a :class:`CriticFeatures` giving the scored state (default: the critic's own ``frame``, or
            ``state_keys`` alone); a sampler without a critic that is to be ranked by an image critic needs it.

    Raises:
        ValueError: ``candidates < 1``, or none of a critic, ``state_keys`` or ``features``.
    """

    def __init__(self, policy, critic: SuccessCritic | None, candidates: int, inner=None,
                 state_keys: Sequence[str] | None = None, features: CriticFeatures | None = None):
        if int(candidates) < 1:
            raise ValueError(f"CriticGuidedSampler: candidates must be >= 1, given {candidates}")
        if critic is None and state_keys is None and features is None:
            raise ValueError("CriticGuidedSampler: give a critic or the state_keys its candidates are scored on")
        self.policy, self.critic, self.candidates = policy, critic, int(candidates)
        if features is None:
            features = critic.frame if critic is not None and state_keys is None else CriticFeatures(state_keys)
        self.features = features
        self.state_keys = features.keys
        self.inner = inner or (policy.predict_action_chunk if policy is not None else None)
        self.picked_own = 0      # decisions where candidate 0 (the policy's own sample) won
        self.decisions = 0
        self.last_scores: torch.Tensor | None = None

    def __call__(self, batch: dict, noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
                 noise_scale: float | torch.Tensor = 1.0, **kw) -> torch.Tensor:
        return self.choose(*self.candidate_chunks(batch, noise, generator, noise_scale, **kw))

    def candidate_chunks(self, batch: dict, noise: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, noise_scale: float | torch.Tensor = 1.0,
                         **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The policy's K candidate chunks for each row, without the critic: ``(chunks (B, K, horizon, A),
        state (B, D), previous state (B, D))``, the states being the last two frames of ``state_keys`` in the
        observation window (the previous is the last when the window has one frame).

        Raises:
            ValueError: the window lacks one of ``state_keys``."""
        K = self.candidates
        H, A = int(self.policy.config.horizon), int(self.policy.config.action_dim)
        keys = self.state_keys
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"CriticGuidedSampler: the observation window lacks {missing} (critic state keys {keys})")
        last = {k: torch.as_tensor(batch[k])[:, -2:] for k in keys}          # the last two frames: (B, <=2, ...)
        B, T = next(iter(last.values())).shape[:2]
        st = self.features({k: v.flatten(0, 1) for k, v in last.items()}).reshape(B, T, -1)   # (B, <=2, D)
        if noise is None:
            noise = torch.randn(B, H, A, generator=generator)
        noise = noise.detach().cpu().float()
        extra = []
        for i in range(B):
            g = torch.Generator().manual_seed(zlib.crc32(noise[i].numpy().tobytes()))
            extra.append(torch.randn(K - 1, H, A, generator=g))
        nz = torch.cat([noise[:, None], torch.stack(extra)], 1).reshape(B * K, H, A)
        scale = noise_scale
        if torch.is_tensor(scale) and scale.numel() > 1:
            scale = scale.reshape(-1).repeat_interleave(K)
        rep = {k: (v.repeat_interleave(K, 0) if torch.is_tensor(v) else np.repeat(np.asarray(v), K, axis=0))
               for k, v in batch.items()}
        chunks = self.inner(rep, noise=nz, noise_scale=scale, **kw)             # (B*K, H, A)
        cur, prev = st[:, -1], st[:, -2] if st.shape[1] > 1 else st[:, -1]
        return chunks.reshape(B, K, H, A), cur, prev

    def choose(self, chunks: torch.Tensor, cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The candidate the critic ranks highest per row, (B, horizon, A), of ``chunks`` (B, K, horizon, A) at
        states ``cur`` / ``prev`` (B, D); the scores (B, K) are kept in ``last_scores``.

        Raises:
            RuntimeError: the sampler has no critic (built with ``state_keys`` only)."""
        if self.critic is None:
            raise RuntimeError("CriticGuidedSampler.choose: this sampler was built without a critic")
        B, K = chunks.shape[:2]
        dev = self.critic.mean.device
        q = self.critic.success_probability(cur.repeat_interleave(K, 0).to(dev), prev.repeat_interleave(K, 0).to(dev),
                                            chunks.flatten(0, 1).to(dev)).reshape(B, K)
        pick = q.argmax(1).to(chunks.device)
        self.last_scores = q.detach().cpu()        # (B, K) of this call (policies.distill reads them)
        self.picked_own += int((pick == 0).sum())
        self.decisions += B
        return chunks[torch.arange(B, device=chunks.device), pick]


def install_critic(policy, directory: str | Path, device: str = "cpu") -> bool:
    """Load ``directory``'s critic (if any) and make it choose ``policy``'s chunks (``policy.chunk_sampler``);
    returns whether one was installed. A policy without ``chunk_sampler`` is left as it is."""
    found = load_critic(directory, device)
    if found is None or not hasattr(policy, "chunk_sampler"):
        return False
    critic, k = found
    missing = [key for key in critic.frame.keys if key not in getattr(policy.config, "input_shapes", {})]
    if missing:
        raise ValueError(f"checkpoint {str(directory)!r}: the critic scores {missing}, which the policy does not observe")
    if k > 1:
        policy.chunk_sampler = CriticGuidedSampler(policy, critic, k, inner=policy.chunk_sampler)
    return True
