"""The policy interface: what every fleetmind policy implements, so the trainer, the fleet (worker, policy
server, learner, evaluation) and the scripts can take any of them through ``policies.factory``.

It is LeRobot's policy surface (``lerobot.policies.pretrained.PreTrainedPolicy``: ``forward``,
``predict_action_chunk``, ``select_action``, ``reset``, ``save_pretrained``/``from_pretrained``) plus the two
things fleetmind's training and serving need: ``build`` (a fresh policy from its Hydra config and the store's
episodes) and ``window_spec`` (the observation/action windows one training sample and one inference step read,
so the sampler, the policy server and deployment build the same conditioning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Policy(Protocol):
    """A fleetmind policy (a ``torch.nn.Module``).

    Attributes:
        name: the ``type`` written in ``config.json`` and looked up by ``policies.factory``.
        config: a dataclass with ``to_dict()``; ``action_dim``, ``horizon`` and ``n_action_steps`` fields and
            ``input_shapes`` (``{observation feature: per-frame shape}``). A diffusion policy's config also has
            ``num_inference_steps`` / ``num_train_timesteps`` (denoising steps; the runtime may change the first).
        tokenizer: the AED action tokenizer run in the DataLoader's collate, or None.
        denoising: the policy samples its chunks from noise (a diffusion policy), and its sampling takes the
            keywords ``predict_action_chunk(batch, noise=None, generator=None, num_inference_steps=None,
            noise_scale=1.0)`` and ``select_action(obs, generator=None, generators=None, noise_scale=1.0)``
            (``generators``: one per batch row, so a row's noise does not depend on the others; ``noise_scale``:
            the temperature of the initial noise). False: they take only the batch / the observation. The fleet,
            the evaluation and the runtime read this declaration instead of inspecting signatures.
    """

    name: str
    config: Any
    tokenizer: Any
    denoising: bool

    @classmethod
    def build(cls, cfg: dict, reader, episodes) -> Policy:
        """A fresh policy from the Hydra ``policy`` node and the store (shapes, statistics over ``episodes``)."""

    def window_spec(self) -> dict[str, tuple[str, list[int]]]:
        """``{sample name: (store key, step offsets)}`` of one training sample (``WindowDataset``); offsets
        <= 0 are what inference reads, positive offsets (the future action chunk) are the training target."""

    def inference_window_spec(self) -> dict[str, tuple[str, list[int]]]:
        """The windows ``predict_action_chunk`` reads at one control step (offsets <= 0 from the current step):
        what the policy server and the runtime build from an observation history."""

    def forward(self, batch: dict) -> tuple[Any, dict[str, float]]:
        """Training loss (scalar tensor; honours ``sample_weight`` ``(B,)`` when given) and logged metrics."""

    def predict_action_chunk(self, batch: dict) -> Any:
        """``(B, horizon, action_dim)`` float32 actions in [-1, 1] from a batch of observation windows."""

    def select_action(self, obs: dict) -> Any:
        """One action per call, queuing the chunk's first ``n_action_steps`` actions."""

    def reset(self) -> None:
        """Forget the episode (observation history, action queue)."""

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` (with ``type``), ``model.safetensors`` and JSON side files; no pickle."""

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str = "cpu") -> Policy:
        """Load a ``save_pretrained`` directory in eval mode; shape mismatches raise ValueError naming them."""

    def load_weights(self, path: str | Path) -> None:
        """Load a ``model.safetensors`` into this policy (training resume); mismatches raise ValueError."""

    def num_parameters(self) -> int:
        """Learned parameters."""
