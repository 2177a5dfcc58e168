"""Configuration of the AED diffusion policy (LeRobot style: one dataclass, checked in ``__post_init__``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from policies.features import POINT_COLORS, point_in_dim


@dataclass
class AEDConfig:
    """Action Experience Dictionary conditioning (docs/AED.md).

    history_actions: H, past actions in the history window. group_size: r, actions per frame interval
    (G = H / r groups, G + 1 history frames at offsets -H, -H + r, ..., 0). memory_queries: M learned
    visual-memory queries. tokenizer_scale / tokenizer_vocab_size: FAST DCT scale and BPE vocabulary, used
    when the training script fits the tokenizer.
    """

    enabled: bool = True
    history_actions: int = 16
    group_size: int = 4
    memory_queries: int = 4
    memory_layers: int = 1
    pooling: str = "mean"            # mean | attention
    token_dim: int | None = None     # embedding-table width (None: model dim)
    tokenizer_scale: float = 10.0
    tokenizer_vocab_size: int = 1024


@dataclass
class MTLossConfig:
    """Motion-aware transition loss (docs/AED.md): weight 0 turns it off. Paper: weight ~0.003-0.01."""

    weight: float = 0.005
    decoder_layers: int = 1
    image_feature_dim: int = 64      # width of the frozen random-conv image features used as MT targets


# Checkpoint migration: fields added to AEDDiffusionConfig after checkpoints were first saved, with the value that
# reproduces the model such a checkpoint's config.json describes (the dataclass default at the time it was
# written). Their dataclass defaults now follow configs/policy/aed_diffusion.yaml, so a config.json lacking them
# must not fall back on those.
CHECKPOINT_MIGRATION: dict[str, object] = {
    "action_patch": 1,         # one denoiser token per action step
    "condition_layers": None,  # every block updates the observation and prefix tokens
}


def migrate_checkpoint_config(d: dict) -> dict:
    """A saved ``config.json`` dict with every ``CHECKPOINT_MIGRATION`` field it lacks filled in with the value of
    the checkpoints saved before that field existed (a copy; the fields it holds are kept)."""
    return {**CHECKPOINT_MIGRATION, **dict(d)}


@dataclass
class AEDDiffusionConfig:
    """Every hyperparameter of the AED diffusion policy.

    Features (LeRobot names): ``input_shapes`` maps each observation key to its per-frame shape:
    ``observation.state``-like keys ``[d]`` (float), ``observation.images.<cam>`` keys ``[H, W, 3]`` (uint8),
    ``observation.point_cloud`` keys ``[N, 3]`` (float32 metres, a depth camera's workspace cloud: DP3's encoder, an
    MLP over points with max-pooling, ``point_channels``; one token per frame), and beside one point cloud optionally
    ``observation.point_colors`` ``[N, 3]`` (uint8 RGB of each point, read by the same encoder as three more inputs
    per point, scaled to [-1, 1]; no token of its own).
    Actions are ``action_dim``-d; ``relative_action_dims`` are summed within a history group,
    ``absolute_action_dims`` take the group's last command.

    Temporal layout (offsets from the anchor step 0): current observation frames ``1 - n_obs_steps .. 0``;
    predicted action chunk ``0 .. horizon - 1`` of which the first ``n_action_steps`` are executed; AED history
    actions ``-H .. -1``; MT future frames ``0, r, ..., horizon``.

    Diffusion: DDPM training with ``num_train_timesteps`` (squared-cosine betas, as Diffusion Policy),
    DDIM sampling with ``num_inference_steps`` (diffusers schedulers).

    Raises:
        ValueError: from ``__post_init__`` on any inconsistent value, naming the field.
    """

    input_shapes: dict[str, list[int]] = field(default_factory=lambda: {
        "observation.state": [4], "observation.environment_state": [17]})
    action_dim: int = 4
    relative_action_dims: list[int] = field(default_factory=lambda: [0, 1, 2])
    absolute_action_dims: list[int] = field(default_factory=lambda: [3])
    n_obs_steps: int = 2
    horizon: int = 16
    n_action_steps: int = 8
    state_norm: str = "min_max"      # min_max ([-1, 1]) | mean_std; images: x / 255 * 2 - 1
    action_norm: str = "min_max"
    # transformer
    dim: int = 96
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: float = 2.0
    dropout: float = 0.0
    # consecutive actions per denoiser action token (horizon / action_patch action tokens; 1: one token per action
    # step). Default as configs/policy/aed_diffusion.yaml; checkpoints saved before the field existed are read with
    # 1 (CHECKPOINT_MIGRATION)
    action_patch: int = 4
    # denoiser blocks that update the observation and prefix tokens (None: all of them); blocks past these attend
    # to the keys/values of the tokens' state after the last one (0: pure cross-attention to the input tokens).
    # Default as configs/policy/aed_diffusion.yaml; checkpoints saved before the field existed are read with None
    condition_layers: int | None = 0
    state_hidden: int = 96
    image_channels: list[int] = field(default_factory=lambda: [16, 32, 64])
    image_pool: int = 2              # image tokens per frame = image_pool ** 2
    # point-cloud encoder widths (DP3: 64, 128, 256, each Linear -> LayerNorm -> ReLU, then max over the points)
    point_channels: list[int] = field(default_factory=lambda: [64, 128, 256])
    # each point also as its offset from the hand (observation.state[:3], the cloud's frame): 6 inputs per point
    point_relative: bool = False
    # diffusion
    num_train_timesteps: int = 100
    beta_schedule: str = "squaredcos_cap_v2"
    prediction_type: str = "epsilon"  # epsilon | sample
    clip_sample: bool = True
    # DDIM/DDPM clip of the predicted clean chunk, in normalized units. None: derived from the action statistics
    # (1.0 for min_max; for mean_std the largest |min - mean| / std or |max - mean| / std of any dimension), so
    # no action the data holds is clipped. An explicit value below that extent is refused.
    clip_sample_range: float | None = None
    num_inference_steps: int = 10
    mask_action_padding: bool = False  # exclude actions past the episode end from the loss
    aed: AEDConfig = field(default_factory=AEDConfig)
    mt_loss: MTLossConfig = field(default_factory=MTLossConfig)

    def __post_init__(self):
        if isinstance(self.aed, dict):
            self.aed = AEDConfig(**self.aed)
        if isinstance(self.mt_loss, dict):
            self.mt_loss = MTLossConfig(**self.mt_loss)
        self.input_shapes = {k: [int(s) for s in v] for k, v in dict(self.input_shapes).items()}
        if not self.input_shapes:
            raise ValueError("input_shapes: at least one observation key is needed")
        for k, shape in self.input_shapes.items():
            if not k.startswith("observation."):
                raise ValueError(f"input_shapes: key {k!r} must start with 'observation.'")
            if k.startswith("observation.images."):
                if len(shape) != 3 or shape[2] != 3:
                    raise ValueError(f"input_shapes[{k!r}]: expected [H, W, 3], given {shape}")
            elif k.startswith("observation.point_cloud") or k == POINT_COLORS:
                if len(shape) != 2 or shape[1] != 3 or shape[0] < 1:
                    raise ValueError(f"input_shapes[{k!r}]: expected [N, 3] points, given {shape}")
            elif len(shape) != 1 or shape[0] < 1:
                raise ValueError(f"input_shapes[{k!r}]: expected [d] for a state key, given {shape}")
        dims = sorted(list(self.relative_action_dims) + list(self.absolute_action_dims))
        if dims != list(range(self.action_dim)):
            raise ValueError(f"relative_action_dims {self.relative_action_dims} + absolute_action_dims "
                             f"{self.absolute_action_dims} must partition range(action_dim={self.action_dim})")
        for name in ("n_obs_steps", "horizon", "n_action_steps", "dim", "n_layers", "n_heads",
                     "num_train_timesteps", "num_inference_steps", "image_pool", "action_patch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, given {getattr(self, name)}")
        if self.n_action_steps > self.horizon:
            raise ValueError(f"n_action_steps ({self.n_action_steps}) must be <= horizon ({self.horizon})")
        if self.condition_layers is not None and self.condition_layers < 0:
            raise ValueError(f"condition_layers: expected >= 0 or None, given {self.condition_layers}")
        if self.horizon % self.action_patch:
            raise ValueError(f"horizon ({self.horizon}) must be a multiple of action_patch ({self.action_patch})")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.num_inference_steps > self.num_train_timesteps:
            raise ValueError(f"num_inference_steps ({self.num_inference_steps}) must be <= num_train_timesteps "
                             f"({self.num_train_timesteps})")
        if self.point_relative and self.point_keys and "observation.state" not in self.input_shapes:
            raise ValueError("point_relative: needs observation.state (the hand's position) among the inputs")
        if POINT_COLORS in self.input_shapes:
            pk = self.point_keys
            if len(pk) != 1 or self.input_shapes[pk[0]][0] != self.input_shapes[POINT_COLORS][0]:
                raise ValueError(f"input_shapes[{POINT_COLORS!r}]: colours need exactly one point cloud of as many "
                                 f"points among the inputs, given {({k: self.input_shapes[k] for k in pk})} and "
                                 f"{self.input_shapes[POINT_COLORS]}")
        if not self.point_channels or min(self.point_channels) < 1:
            raise ValueError(f"point_channels: expected positive widths, given {self.point_channels}")
        for name in ("state_norm", "action_norm"):
            if getattr(self, name) not in ("min_max", "mean_std"):
                raise ValueError(f"{name}: expected 'min_max' or 'mean_std', given {getattr(self, name)!r}")
        if self.prediction_type not in ("epsilon", "sample"):
            raise ValueError(f"prediction_type: expected 'epsilon' or 'sample', given {self.prediction_type!r}")
        a = self.aed
        if a.pooling not in ("mean", "attention"):
            raise ValueError(f"aed.pooling: expected 'mean' or 'attention', given {a.pooling!r}")
        if a.group_size < 1 or a.history_actions < a.group_size or a.history_actions % a.group_size:
            raise ValueError(f"aed.history_actions ({a.history_actions}) must be a positive multiple of "
                             f"aed.group_size ({a.group_size})")
        if a.memory_queries < 1:
            raise ValueError(f"aed.memory_queries: expected >= 1, given {a.memory_queries}")
        if self.mt_loss.weight < 0:
            raise ValueError(f"mt_loss.weight: expected >= 0, given {self.mt_loss.weight}")
        if self.mt_loss.weight > 0 and self.horizon % a.group_size:
            raise ValueError(f"with the MT loss on, horizon ({self.horizon}) must be a multiple of "
                             f"aed.group_size ({a.group_size}) (future frame intervals)")

    @property
    def state_keys(self) -> list[str]:
        """Vector observation keys (``[d]``): one MLP token each."""
        return [k for k in self.input_shapes
                if not k.startswith(("observation.images.", "observation.point_cloud")) and k != POINT_COLORS]

    @property
    def point_keys(self) -> list[str]:
        """Point-cloud keys (``[N, 3]``): one point-encoder token each."""
        return [k for k in self.input_shapes if k.startswith("observation.point_cloud")]

    @property
    def point_color(self) -> bool:
        """Whether the point encoder also reads each point's colour (``observation.point_colors`` is an input)."""
        return POINT_COLORS in self.input_shapes

    @property
    def point_in_dim(self) -> int:
        """Inputs per point of the point encoder: 3 coordinates, +3 the offset from the hand (``point_relative``),
        +3 the colour (``point_color``)."""
        return point_in_dim(self.point_relative, self.point_color)

    @property
    def normalized_keys(self) -> list[str]:
        """Keys normalised from the store's statistics (per dimension; a point cloud per coordinate)."""
        return self.state_keys + self.point_keys

    @property
    def image_keys(self) -> list[str]:
        return [k for k in self.input_shapes if k.startswith("observation.images.")]

    @property
    def num_groups(self) -> int:
        return self.aed.history_actions // self.aed.group_size

    def to_dict(self) -> dict:
        """JSON-able dict (nested dataclasses as dicts)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> AEDDiffusionConfig:
        """Build from a dict (a Hydra node, or a checkpoint's config.json after :func:`migrate_checkpoint_config`);
        a missing key takes the dataclass default, unknown keys raise ValueError."""
        d = dict(d)
        d.pop("type", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"AEDDiffusionConfig: unknown keys {unknown}")
        return cls(**d)
