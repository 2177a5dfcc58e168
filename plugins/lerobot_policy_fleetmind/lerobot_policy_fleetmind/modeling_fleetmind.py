"""A fleetmind export behind LeRobot 0.6.1's ``PreTrainedPolicy``: what ``lerobot-eval --policy.path=...`` runs.

The policy acts through fleetmind's lean runtime (``policies.runtime.PolicyRuntime``): the same weights, the same
observation/action history windows (``policies.history.WindowHistory``), the same DDIM sampling and, when the export
has them, the same success critic choosing among sampled chunks and the same ONNX graph as fleetmind's evaluation
and a deployed robot. LeRobot's rollout gives batched observations ``{feature: (B, ...) float32 tensor}``
(``observation.state``, ``observation.environment_state``, ``observation.images.<camera>`` in [0, 1] (B, 3, H, W));
the policy takes the features its export lists and returns ``(B, action_dim)`` float32 actions in raw units.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lerobot.configs.policies import PreTrainedConfig
from lerobot.policies.pretrained import PreTrainedPolicy
from torch import Tensor

from lerobot_policy_fleetmind.configuration_fleetmind import POLICY_TYPE, FleetmindConfig

TRAINING_REFUSAL = ("a fleetmind policy is trained by fleetmind (scripts/train.py, or the fleet job scripts/run.py) "
                    "and exported (scripts/export.py, then python -m lerobot_policy_fleetmind.export); LeRobot "
                    "loads the export with --policy.path=<folder>")


class FleetmindPolicy(PreTrainedPolicy):
    """A loaded fleetmind export (see module doc). Build it with :meth:`from_pretrained`.

    Args:
        config: the LeRobot config (:class:`FleetmindConfig`).
        runtime: the loaded ``PolicyRuntime``; required (a fresh, untrained fleetmind policy is not made here).
    Raises:
        NotImplementedError: without ``runtime`` (``lerobot-train --policy.type=fleetmind``): the message says
            how fleetmind policies are trained and exported.
    """

    config_class = FleetmindConfig
    name = POLICY_TYPE

    def __init__(self, config: FleetmindConfig, runtime=None, **_: Any):
        super().__init__(config)
        if runtime is None:
            raise NotImplementedError(TRAINING_REFUSAL)
        self.runtime = runtime
        self.model = runtime.policy            # a submodule, so LeRobot's .to(device) / .eval() reach it
        self.input_keys = list(runtime.input_shapes)

    @classmethod
    def from_pretrained(cls, pretrained_name_or_path: str | Path, *, config: FleetmindConfig | None = None,
                        **_: Any) -> FleetmindPolicy:
        """Load a LeRobot policy folder of type ``fleetmind`` (``python -m lerobot_policy_fleetmind.export``).

        Args:
            pretrained_name_or_path: a local folder (nothing is downloaded).
            config: LeRobot's parsed config (``make_policy`` passes it, with command-line overrides applied);
                None: read from the folder's ``config.json``.
        Raises:
            FileNotFoundError: not a local folder, or no fleetmind export in it (names the path).
            ValueError: the export fails its sha256 check or the runtime refuses an option (``policies.runtime``).
        """
        from policies.runtime import PolicyRuntime

        folder = Path(pretrained_name_or_path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{str(folder)!r}: a fleetmind LeRobot policy is a local folder "
                                    "(python -m lerobot_policy_fleetmind.export writes one)")
        if config is None:
            config = PreTrainedConfig.from_pretrained(folder)
        export = folder / config.export_subdir
        if not (export / "export.json").is_file():
            raise FileNotFoundError(f"{str(export)!r} holds no fleetmind export (export.json)")
        runtime = PolicyRuntime.load(export, device=config.device or "cpu", backend=config.backend,
                                     num_inference_steps=config.num_inference_steps, num_threads=config.num_threads)
        if runtime.critic and not config.use_critic:  # the policy alone: the sampler the critic wrapped
            from policies.critic import CriticGuidedSampler

            sampler = runtime.policy.chunk_sampler
            if isinstance(sampler, CriticGuidedSampler):
                runtime.policy.chunk_sampler = sampler.inner
            runtime.critic = False
        return cls(config, runtime=runtime)

    def _observation(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        missing = [k for k in self.input_keys if k not in batch]
        if missing:
            raise ValueError(f"observation lacks {missing} (the export's inputs: {self.input_keys}; "
                             f"given {sorted(k for k in batch if k.startswith('observation'))})")
        out = {}
        for k in self.input_keys:
            x = batch[k]
            if k.startswith("observation.images.") and x.dim() == 4 and x.shape[1] == 3:
                # LeRobot: (B, 3, H, W) float in [0, 1]; fleetmind's image inputs: (B, H, W, 3) uint8 pixels. A camera
                # at another resolution (LeRobot's Meta-World env renders 480 x 480) is resized to the export's by
                # area averaging (torch.nn.functional.interpolate, mode "area")
                h, w = (int(s) for s in self.runtime.input_shapes[k][:2])
                if tuple(x.shape[-2:]) != (h, w):
                    x = torch.nn.functional.interpolate(x.float(), size=(h, w), mode="area")
                x = (x.permute(0, 2, 3, 1) * 255).round().clamp(0, 255).to(torch.uint8)
            else:
                x = x.float()
            out[k] = x.cpu() if self.runtime.backend != "torch" else x
        return out

    def reset(self) -> None:
        """Forget the episode: the history windows and the action queue (LeRobot calls it at every rollout start)."""
        self.runtime.reset()

    @torch.no_grad()
    def select_action(self, batch: dict[str, Tensor], **_: Any) -> Tensor:
        """One control step for B environments: ``(B, action_dim)`` float32, raw units (``export.json``).

        Keeps the observation and executed-action windows itself and plans a chunk every ``n_action_steps`` steps.
        """
        return self.runtime.policy.select_action(self._observation(batch))

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict[str, Tensor], **_: Any) -> Tensor:
        """``(B, horizon, action_dim)``: a chunk from this observation alone (windows edge-padded as at an
        episode's first step; ``select_action`` conditions on the episode's history instead)."""
        from policies.history import WindowHistory

        pol = self.runtime.policy
        hist = WindowHistory(pol.inference_window_spec(), pol.config.action_dim)
        hist.push_obs(self._observation(batch))
        return self.runtime.predict_action_chunk(hist.batch())

    def forward(self, batch: dict[str, Tensor], **_: Any):
        """Refused: see :data:`TRAINING_REFUSAL`."""
        raise NotImplementedError(TRAINING_REFUSAL)

    def get_optim_params(self) -> dict:
        return {"params": [p for p in self.parameters() if p.requires_grad]}
