"""A fleetmind export behind LeRobot 0.6.1's ``PreTrainedPolicy``: what ``lerobot-eval --policy.path=...`` runs.

The policy acts through fleetmind's lean runtime (``policies.runtime.PolicyRuntime``): the same weights, the same
observation/action history windows (``policies.history.WindowHistory``), the same DDIM sampling and, when the export
has them, the same success critic choosing among sampled chunks and the same ONNX graph as fleetmind's evaluation
and a deployed robot. LeRobot's rollout gives batched observations ``{feature: (B, ...) float32 tensor}``
(``observation.state``, ``observation.environment_state``, ``observation.images.<camera>`` in [0, 1] (B, 3, H, W));
the policy takes the features its export lists and returns ``(B, action_dim)`` float32 actions in raw units.

With ``robot_bridge`` (an export written with ``--robot so100``) the policy drives a LeRobot robot itself, as
``lerobot-rollout`` asks: it takes the arm's joint readings as ``observation.state`` and returns joint targets,
mapped through fleetmind's deploy bridge (the same forward kinematics, controller and IK as ``scripts/deploy.py``;
LeRobot's rollout has no fleetmind safety filter: the robot's own joint limits clip the targets).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lerobot.configs.policies import PreTrainedConfig
from lerobot.policies.pretrained import PreTrainedPolicy
from torch import Tensor

from lerobot_policy_fleetmind.configuration_fleetmind import POLICY_TYPE, FleetmindConfig

log = logging.getLogger(__name__)

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
        self.bridge = None
        if config.robot_bridge is not None:   # the policy drives a LeRobot robot: joints in, joint targets out
            from fleet.deploy.lerobot_bridge import ENV_STATE_KEY, IMAGE_PREFIX, make_bridge

            if ENV_STATE_KEY in runtime.input_shapes:
                raise ValueError(f"policy.robot_bridge={config.robot_bridge}: the export reads {ENV_STATE_KEY!r} "
                                 "(the object state), which no LeRobot robot gives a policy; export a policy that "
                                 "sees proprioception and cameras (experiment=vision_cpu)")
            # images take the plugin's own path (rename, resize); the bridge maps the state, the point cloud (from
            # the robot's depth images, config.depth_cameras) and the actions
            shapes = {k: v for k, v in runtime.input_shapes.items() if not k.startswith(IMAGE_PREFIX)}
            crop = config.point_crop or [None, None]
            self.bridge = make_bridge(config.robot_bridge, shapes, runtime.meta["features"]["action"]["names"],
                                      action_scale_m=config.action_scale_m, depth_cameras=config.depth_cameras,
                                      crop_min=crop[0], crop_max=crop[1])
        self._robot_obs: dict | None = None   # robot mode: the joint readings of the step being acted on
        self._step = 0
        self._source: Path | None = None   # the folder it was loaded from: save_pretrained carries its files on

    def _save_pretrained(self, save_directory: Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """What LeRobot's ``save_pretrained`` / ``push_to_hub`` write: the folder this policy was loaded from (its
        processors and model card ``README.md``), the fleetmind export (weights with their sha256, the ONNX graph,
        the critic) in ``config.export_subdir``, and ``config.json`` from the current config. No separate
        ``model.safetensors``: the export's weights are the policy's (``from_pretrained`` checks them).

        Raises:
            FileNotFoundError: a policy without an export folder to carry (one not loaded by ``from_pretrained``)."""
        import shutil

        save_directory = Path(save_directory)
        export = getattr(self.runtime, "folder", None)
        if export is None:
            raise FileNotFoundError("save_pretrained: this fleetmind policy has no export folder to carry "
                                    "(load it with FleetmindPolicy.from_pretrained)")
        if self._source is not None and self._source.resolve() != save_directory.resolve():
            for f in self._source.iterdir():
                if f.is_file() and f.name != "config.json":
                    shutil.copy2(f, save_directory / f.name)
        dest = save_directory / self.config.export_subdir
        if Path(export).resolve() != dest.resolve():
            shutil.copytree(export, dest, dirs_exist_ok=True)
        if not (save_directory / "README.md").is_file() and (Path(export) / "README.md").is_file():
            shutil.copy2(Path(export) / "README.md", save_directory / "README.md")   # the export's model card
        self.config._save_pretrained(save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_name_or_path: str | Path, *, config: FleetmindConfig | None = None,
                        cache_dir: str | Path | None = None, revision: str | None = None,
                        **_: Any) -> FleetmindPolicy:
        """Load a LeRobot policy folder of type ``fleetmind`` (``python -m lerobot_policy_fleetmind.export``, or a
        policy's ``save_pretrained`` / ``push_to_hub``).

        Args:
            pretrained_name_or_path: a local folder, or a Hub repo id (``user/name``) already in the local Hub cache
                (``huggingface_hub.snapshot_download(local_files_only=True)``: nothing is downloaded).
            config: LeRobot's parsed config (``make_policy`` passes it, with command-line overrides applied);
                None: read from the folder's ``config.json``.
            cache_dir, revision: the Hub cache and revision for a repo id.
        Raises:
            FileNotFoundError: neither a local folder nor a cached repo, or no fleetmind export in it (names it).
            ValueError: the export fails its sha256 check or the runtime refuses an option (``policies.runtime``).
        """
        from policies.runtime import PolicyRuntime

        folder = Path(pretrained_name_or_path)
        if not folder.is_dir():
            try:
                from huggingface_hub import snapshot_download

                folder = Path(snapshot_download(str(pretrained_name_or_path), cache_dir=cache_dir, revision=revision,
                                                local_files_only=True))
            except Exception as e:  # noqa: BLE001 - not a repo id, or not cached: one clear error
                raise FileNotFoundError(
                    f"{str(pretrained_name_or_path)!r} is neither a local folder nor a Hub repo in the local cache "
                    f"({type(e).__name__}); nothing is downloaded: fetch it first (huggingface-cli download) or give "
                    "the folder python -m lerobot_policy_fleetmind.export wrote") from None
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
        policy = cls(config, runtime=runtime)
        policy._source = folder
        return policy

    def _from_robot(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Robot mode: LeRobot's frame (``observation.state`` = (1, 6) joint readings in the robot's
        ``<joint>.pos`` order, degrees; cameras as LeRobot gives them) -> the policy's features: the bridge's
        end-effector state (and ``observation.embodiment`` for a mixed fleet's policy) beside the cameras."""
        from fleet.deploy.lerobot_bridge import MOTOR_KEYS

        state = batch.get("observation.state")
        if state is None or state.dim() != 2 or tuple(state.shape) != (1, len(MOTOR_KEYS)):
            got = None if state is None else tuple(state.shape)
            raise ValueError(f"policy.robot_bridge={self.config.robot_bridge}: observation.state must be one robot's "
                             f"{len(MOTOR_KEYS)} joint readings {list(MOTOR_KEYS)}, shape (1, {len(MOTOR_KEYS)}); "
                             f"given {got}")
        self._robot_obs = dict(zip(MOTOR_KEYS, state[0].double().cpu().tolist()))
        if self._step == 0:   # the episode's first step: the controller starts from the measured arm
            self.bridge.reset(self._robot_obs)
        depth = self._depth_images(batch)
        mapped = {k: torch.from_numpy(v)[None].to(state.device)
                  for k, v in self.bridge.policy_observation({**self._robot_obs, **depth}).items()}
        return {**batch, **mapped}

    def _depth_images(self, batch: dict[str, Tensor]) -> dict[str, np.ndarray]:
        """Robot mode, a point-cloud policy: the robot's depth images as the bridge takes them, from LeRobot's frame
        (``observation.images.<camera>_depth`` (1, 1, H, W) in the calibration's depth units, as LeRobot's
        ``prepare_observation_for_inference`` leaves a (H, W, 1) depth feature; ``<camera>_depth_rgb`` (1, 3, H, W)
        in [0, 1]) -> ``{"<camera>_depth": (H, W), "<camera>_depth_rgb": (H, W, 3) uint8}``.

        Raises:
            ValueError: a depth image the frame lacks or of another shape (names it)."""
        from fleet.deploy.lerobot_bridge import COLORS_KEY, DEPTH_RGB_SUFFIX, DEPTH_SUFFIX, IMAGE_PREFIX

        out: dict[str, np.ndarray] = {}
        for cam in self.bridge.depth_cameras if hasattr(self.bridge, "depth_cameras") else {}:
            key = IMAGE_PREFIX + cam + DEPTH_SUFFIX
            x = batch.get(key)
            if x is None or x.dim() != 4 or x.shape[:2] != (1, 1):
                raise ValueError(f"policy.depth_cameras: the frame lacks {key!r} as one robot's (1, 1, H, W) depth "
                                 f"image (given {None if x is None else tuple(x.shape)}); the robot must give "
                                 f"'{cam}{DEPTH_SUFFIX}' (H, W, 1)")
            out[cam + DEPTH_SUFFIX] = x[0, 0].float().cpu().numpy()
            if COLORS_KEY in self.bridge.input_shapes:
                key = IMAGE_PREFIX + cam + DEPTH_RGB_SUFFIX
                x = batch.get(key)
                if x is None or x.dim() != 4 or x.shape[:2] != (1, 3):
                    raise ValueError(f"policy.depth_cameras: the frame lacks {key!r} as one robot's (1, 3, H, W) "
                                     f"colour image (given {None if x is None else tuple(x.shape)})")
                out[cam + DEPTH_RGB_SUFFIX] = (x[0].permute(1, 2, 0).float().cpu() * 255).round().clamp(0, 255) \
                    .to(torch.uint8).numpy()
        return out

    def _to_robot(self, action: Tensor) -> Tensor:
        """Robot mode: the policy's (1, 4) end-effector action -> (1, 6) joint targets (``<joint>.pos`` order).
        A non-finite action holds the arm where it is measured (the targets are the joint readings), logged, as
        fleetmind's deploy loop does; NaN never reaches the robot."""
        targets = self.bridge.propose(action[0].double().cpu().numpy(), self._robot_obs, self._step)
        if not np.all(np.isfinite(targets)):
            log.warning("fleetmind policy: non-finite action %s at step %d: holding the arm",
                        action[0].tolist(), self._step)
            targets = self.bridge.joints(self._robot_obs)
        self.bridge.sent(targets)
        self._step += 1
        return torch.from_numpy(targets.astype("float32"))[None]

    def _observation(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        if self.bridge is not None:
            batch = self._from_robot(batch)
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
        """Forget the episode: the history windows and the action queue (LeRobot calls it at every rollout start);
        in robot mode the next step also restarts the bridge's controller from the measured arm."""
        self.runtime.reset()
        self._step = 0

    @torch.no_grad()
    def select_action(self, batch: dict[str, Tensor], **_: Any) -> Tensor:
        """One control step for B environments: ``(B, action_dim)`` float32, raw units (``export.json``).

        Keeps the observation and executed-action windows itself and plans a chunk every ``n_action_steps`` steps.
        Robot mode (``robot_bridge``): one robot, ``(1, 6)`` joint targets instead (see :meth:`_from_robot`).
        """
        action = self.runtime.policy.select_action(self._observation(batch))
        return action if self.bridge is None else self._to_robot(action)

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict[str, Tensor], **_: Any) -> Tensor:
        """``(B, horizon, action_dim)``: a chunk from this observation alone (windows edge-padded as at an
        episode's first step; ``select_action`` conditions on the episode's history instead)."""
        from policies.history import WindowHistory

        if self.bridge is not None:
            raise NotImplementedError(f"policy.robot_bridge={self.config.robot_bridge}: the policy acts step by step "
                                      "(each joint target comes from the arm measured at that step); use "
                                      "lerobot-rollout's --inference.type=sync, which calls select_action")
        pol = self.runtime.policy
        hist = WindowHistory(pol.inference_window_spec(), pol.config.action_dim)
        hist.push_obs(self._observation(batch))
        return self.runtime.predict_action_chunk(hist.batch())

    def forward(self, batch: dict[str, Tensor], **_: Any):
        """Refused: see :data:`TRAINING_REFUSAL`."""
        raise NotImplementedError(TRAINING_REFUSAL)

    def get_optim_params(self) -> dict:
        return {"params": [p for p in self.parameters() if p.requires_grad]}
