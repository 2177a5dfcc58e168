"""The FERT retrieval key: what a failure context and a successful window are compared by.

:class:`RelativeEmbedder` (the default, ``fert.key: relative``): a 16-d key of the relative geometry (hand to
object, hand to goal, object to goal, the last window's motion, the gripper), in metres, compared by L2 distance.
:class:`ContextEmbedder` (``fert.key: absolute``): normalised state windows plus, optionally, an action-history
part (:func:`aed_history_encoder`, the AED's token embeddings) or a policy's own encoder
(:func:`policy_encoder`), compared by cosine similarity.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

STATE_KEYS = ("observation.state", "observation.environment_state")
Encoder = Callable[[dict[str, np.ndarray]], np.ndarray]


# ----------------------------------------------------------------------------------------- embedding
class ContextEmbedder:
    """Embeds observation windows for cosine-similarity search.

    A window is the ``frames`` observations at steps ``anchor - (frames - 1) * stride .. anchor`` (edge-padded
    at the episode start). Without an ``encoder``, each key is normalised with the store statistics
    (``(x - mean) / max(std, std_floor)``, per dimension), each key's block is divided by ``sqrt(D_key)`` so
    every feature group counts equally whatever its width, the window is pooled and the result L2-normalised.
    With an ``encoder`` (e.g. the policy's observation encoder features), the raw windows go to the encoder
    and only its output is L2-normalised.

    Args:
        stats: ``reader.stats(keys)`` output: ``{key: {"mean": [D], "std": [D], ...}}``; frozen here, so
            embeddings stay comparable as the store grows. Unused with an ``encoder``.
        keys: observation keys to embed (default: ``observation.state`` + ``observation.environment_state``).
        frames: frames per window (the context length W in steps when ``stride == 1``), >= 1.
        stride: steps between frames, >= 1.
        pool: ``"flatten"`` (frames x D), ``"mean"`` (D) or ``"last"`` (D).
        encoder: optional ``f({key: (N, frames, ...) raw array}) -> (N, E)`` float array.
        std_floor: lower bound on std (feature units), avoids blowing up near-constant dimensions.

    Raises:
        KeyError: a key has no stats (when no encoder is given).
        ValueError: bad ``frames``, ``stride`` or ``pool``.
    """

    def __init__(self, stats: Mapping[str, Mapping[str, Sequence[float]]] | None,
                 keys: Sequence[str] = STATE_KEYS, frames: int = 8, stride: int = 1,
                 pool: str = "flatten", encoder: Encoder | None = None, std_floor: float = 1e-3):
        if frames < 1 or stride < 1:
            raise ValueError(f"frames and stride: expected >= 1, given frames={frames}, stride={stride}")
        if pool not in ("flatten", "mean", "last"):
            raise ValueError(f"pool: expected 'flatten', 'mean' or 'last', given {pool!r}")
        self.keys, self.frames, self.stride, self.pool, self.encoder = tuple(keys), frames, stride, pool, encoder
        self.offsets = -np.arange(frames - 1, -1, -1, dtype=np.int64) * stride      # (F,) ascending, ends at 0
        self._norm = {}
        if encoder is None:
            stats = stats or {}
            for k in self.keys:
                if k not in stats:
                    raise KeyError(f"ContextEmbedder: no stats for key {k!r} (given keys {sorted(stats)})")
                mean = np.asarray(stats[k]["mean"], np.float32)
                std = np.maximum(np.asarray(stats[k]["std"], np.float32), std_floor)
                self._norm[k] = (mean, std * np.sqrt(mean.size, dtype=np.float32))

    def windows(self, data: Mapping[str, np.ndarray], anchors: np.ndarray) -> dict[str, np.ndarray]:
        """Gather windows from one episode's arrays.

        Args:
            data: ``{key: (T, ...) array}`` of one episode (``reader.load_episode``).
            anchors: (N,) int steps in ``[0, T)``; each window ends at its anchor.

        Returns:
            ``{key: (N, frames, ...) array}``; steps before 0 repeat step 0.

        Raises:
            KeyError: a key is missing from ``data``. ValueError: an anchor is out of the episode.
        """
        missing = [k for k in self.keys if k not in data]
        if missing:
            raise KeyError(f"ContextEmbedder.windows: episode data lacks keys {missing}")
        T = len(data[self.keys[0]])
        anchors = np.asarray(anchors, dtype=np.int64)
        if anchors.size and (anchors.min() < 0 or anchors.max() >= T):
            raise ValueError(f"anchors: expected steps in [0, {T}), given [{anchors.min()}, {anchors.max()}]")
        idx = np.clip(anchors[:, None] + self.offsets[None, :], 0, T - 1)     # (N, F)
        return {k: np.asarray(data[k])[idx] for k in self.keys}

    def embed(self, windows: Mapping[str, np.ndarray]) -> np.ndarray:
        """(N, E) float32 L2-normalised embeddings of ``{key: (N, frames, ...)}`` windows."""
        if self.encoder is not None:
            z = np.asarray(self.encoder(dict(windows)), dtype=np.float32)
            if z.ndim != 2:
                raise ValueError(f"encoder output: expected (N, E), given shape {z.shape}")
        else:
            parts = []
            for k in self.keys:
                mean, scale = self._norm[k]
                x = (np.asarray(windows[k], np.float32) - mean) / scale                # (N, F, D)
                x = {"flatten": lambda a: a.reshape(len(a), -1), "mean": lambda a: a.mean(1),
                     "last": lambda a: a[:, -1]}[self.pool](x)
                parts.append(x)
            z = np.concatenate(parts, axis=1).astype(np.float32)
        return np.ascontiguousarray(z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12))

    def embed_episode(self, data: Mapping[str, np.ndarray], anchors: np.ndarray,
                      chunk: int = 1024) -> np.ndarray:
        """(N, E) embeddings of the windows ending at ``anchors`` of one episode, in chunks of ``chunk``."""
        anchors = np.asarray(anchors, dtype=np.int64)
        out = [self.embed(self.windows(data, anchors[i:i + chunk])) for i in range(0, len(anchors), chunk)]
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


class RelativeEmbedder:
    """Task-relative failure-cause key: where the hand, the object and the goal are relative to each other,
    and how they move, in metres; searched by L2 distance.

    Absolute coordinates under cosine similarity put the neighbours of a failing reach a median 6.0 cm from
    its goal (the success radius is 5 cm): the key could not see why the policy failed. This key is built from
    the quantities a failure is about, the way Behavior Retrieval (Du et al., 2023) and STRAP (Memmel et al.,
    2025) retrieve sub-trajectories by what the robot and the objects do. Per window ending at step ``t``
    (``frames`` steps, edge-padded at the episode start), with hand ``h`` (``observation.state[:3]``), gripper
    opening ``g`` (``observation.state[3]``, 0..1), object ``o`` (``observation.environment_state[0:3]``) and
    goal ``p`` (``observation.environment_state[14:17]``), all in metres (Meta-World layout,
    ``sim.metaworld_env``)::

        [h_t - o_t, h_t - p_t, o_t - p_t, h_t - h_{t-F+1}, o_t - o_{t-F+1}, g_t * gripper_scale]   (16,)

    The two displacement terms are the hand's and the object's motion over the window (velocity x window).
    The distance between two keys is in metres (the gripper term contributes at most ``gripper_scale``).
    ``extra`` (optional) appends a further per-window embedding of the ``history_actions`` actions before the
    anchor, e.g. the policy's pooled AED action-history embedding (:func:`aed_history_encoder`), which carries
    how the unit responds to commands; ``extra_scale`` puts it in metres-comparable units.

    Args:
        frames: window length in steps (>= 2 for the motion terms; 1 gives zero motion). stride: steps between
            frames (>= 1). gripper_scale: metres per unit of gripper opening in the key (>= 0).
        extra: optional ``f({"action": (N, H, A), "action_is_pad": (N, H)}) -> (N, E)``; extra_scale: its
            factor; history_actions: H.

    Raises:
        ValueError: bad ``frames``/``stride``.
    """

    metric = "l2"
    keys = STATE_KEYS

    def __init__(self, frames: int = 8, stride: int = 1, gripper_scale: float = 0.05,
                 extra: Encoder | None = None, extra_scale: float = 1.0, history_actions: int = 0):
        if frames < 1 or stride < 1 or history_actions < 0:
            raise ValueError(f"frames and stride: expected >= 1 and history_actions >= 0, given frames={frames}, "
                             f"stride={stride}, history_actions={history_actions}")
        self.frames, self.stride, self.gripper_scale = int(frames), int(stride), float(gripper_scale)
        self.extra, self.extra_scale = extra, float(extra_scale)
        self.history_actions = int(history_actions) if extra is not None else 0
        self.keys = tuple(STATE_KEYS) + (("action",) if self.history_actions else ())
        self.offsets = -np.arange(frames - 1, -1, -1, dtype=np.int64) * stride

    def windows(self, data: Mapping[str, np.ndarray], anchors: np.ndarray) -> dict[str, np.ndarray]:
        """State windows as :meth:`ContextEmbedder.windows`; with an action-history encoder also ``action``
        (N, H, A): the H actions before each anchor, and ``action_is_pad`` (N, H) for steps before the start."""
        missing = [k for k in self.keys if k not in data]
        if missing:
            raise KeyError(f"RelativeEmbedder.windows: episode data lacks keys {missing}")
        T = len(data[STATE_KEYS[0]])
        anchors = np.asarray(anchors, dtype=np.int64)
        if anchors.size and (anchors.min() < 0 or anchors.max() >= T):
            raise ValueError(f"anchors: expected steps in [0, {T}), given [{anchors.min()}, {anchors.max()}]")
        idx = np.clip(anchors[:, None] + self.offsets[None, :], 0, T - 1)
        out = {k: np.asarray(data[k])[idx] for k in STATE_KEYS}
        if self.history_actions:
            h = anchors[:, None] + np.arange(-self.history_actions, 0)[None, :]          # (N, H)
            out["action"] = np.asarray(data["action"])[np.clip(h, 0, T - 1)]
            out["action_is_pad"] = h < 0
        return out

    embed_episode = ContextEmbedder.embed_episode

    def embed(self, windows: Mapping[str, np.ndarray]) -> np.ndarray:
        """(N, 16 [+ E]) float32 keys of ``{key: (N, frames, D)}`` windows (metres; see the class docstring)."""
        st = np.asarray(windows["observation.state"], np.float32)               # (N, F, 4)
        env = np.asarray(windows["observation.environment_state"], np.float32)  # (N, F, 17)
        if st.shape[-1] < 4 or env.shape[-1] < 17:
            raise ValueError(f"RelativeEmbedder: expected state (.., 4) and environment_state (.., 17), given "
                             f"{st.shape} and {env.shape}")
        h, g = st[..., :3], st[..., 3]
        o, p = env[..., 0:3], env[..., 14:17]
        parts = [h[:, -1] - o[:, -1], h[:, -1] - p[:, -1], o[:, -1] - p[:, -1], h[:, -1] - h[:, 0],
                 o[:, -1] - o[:, 0], g[:, -1:] * self.gripper_scale]
        if self.extra is not None:
            parts.append(np.asarray(self.extra(dict(windows)), np.float32) * self.extra_scale)
        return np.ascontiguousarray(np.concatenate(parts, axis=1).astype(np.float32))

def aed_history_encoder(policy, scale_m: float = 0.05) -> tuple[Encoder, float, int]:
    """The AED action-history part of the retrieval key, from an AED diffusion policy (duck-typed:
    ``policy.tokenize_history``, ``policy.aed``, ``policy.config.aed``; experience_dict does not import policies).

    The H actions before an anchor are tokenized by the policy's action tokenizer and embedded by its Action
    Experience Dictionary to one vector per group ((N, G, D), layer-normalised); the valid groups are averaged
    to (N, D). Returns ``(encoder, extra_scale, H)`` for :class:`RelativeEmbedder`, with ``extra_scale =
    scale_m / sqrt(D)`` so two unrelated histories (distance ~ sqrt(2 D) after the layer norm) sit ~1.4 x
    ``scale_m`` metres apart in the key.

    Raises:
        ValueError: the policy has no AED.
    """
    cfg = getattr(getattr(policy, "config", None), "aed", None)
    if cfg is None or not cfg.enabled or getattr(policy, "aed", None) is None:
        raise ValueError("aed_history_encoder: the policy has no Action Experience Dictionary (aed.enabled=false)")
    H = int(cfg.history_actions)

    @torch.no_grad()
    def encode(windows: dict[str, np.ndarray]) -> np.ndarray:
        b = policy.tokenize_history({"history.action": np.asarray(windows["action"], np.float32),
                                     "history.action_is_pad": np.asarray(windows["action_is_pad"], bool)})
        dev = policy.device
        g = policy.aed(b["history.tokens"].to(dev), b["history.token_mask"].bool().to(dev),
                       b["history.group_mask"].bool().to(dev))                   # (N, G, D)
        m = b["history.group_mask"].bool().to(dev).float()[..., None]
        z = (g * m).sum(1) / m.sum(1).clamp(min=1.0)
        return z.float().cpu().numpy()

    dim = int(getattr(policy.config, "dim", 128))
    return encode, float(scale_m) / float(np.sqrt(dim)), H


def policy_encoder(policy, pool: str = "mean") -> Encoder:
    """An ``encoder`` for :class:`ContextEmbedder` from an AED diffusion policy's observation encoder.

    Feeds the raw windows (``{key: (N, F, ...)}``, the policy's ``config.input_shapes`` keys) through the
    policy's own normalisation and ``obs_encoder`` -> ``(N, F, K, dim)`` tokens, averaged over the K tokens of
    a frame and pooled over frames (``"mean"``) or flattened (``"flatten"``) -> ``(N, E)`` float32, no grad.
    Duck-typed (``policy.obs_encoder``, ``policy._frames``, ``policy.device``): experience_dict does not
    import policies.
    """
    if pool not in ("mean", "flatten"):
        raise ValueError(f"pool: expected 'mean' or 'flatten', given {pool!r}")

    @torch.no_grad()
    def encode(windows: dict[str, np.ndarray]) -> np.ndarray:
        batch = {k: torch.as_tensor(np.asarray(v)).to(policy.device) for k, v in windows.items()}
        tok = policy.obs_encoder(policy._frames(batch)).mean(dim=-2)           # (N, F, dim)
        z = tok.mean(dim=1) if pool == "mean" else tok.flatten(1)
        return z.float().cpu().numpy()

    return encode


