"""The action-chunk sampler as an ONNX graph, run by ONNX Runtime: the lean runtime's fast CPU path.

Why: at batch 1 the eager PyTorch sampler of the default state policy (10 DDIM steps x 4 blocks, 16 action
tokens, dim 96) spends most of its time in per-op dispatch, not arithmetic (``scripts/bench_runtime.py``). ONNX
Runtime runs the same graph with a fraction of that overhead (docs/DEPENDENCIES.md has the measured ratio).

What is exported: the policy's whole sampler after the action-history tokenization, at a fixed DDIM step count
and a fixed batch size: ``(noise, inference windows, history tokens) -> raw actions``
(``AEDDiffusionPolicy.chunk_graph``). The DDIM updates are diffusers' ``DDIMScheduler.step``, traced. The BPE
tokenization of the action history stays in Python (HF ``tokenizers``), so the runtime feeds the graph exactly
what the PyTorch path computes. Exporting needs ``onnx`` and ``onnxscript`` (the ``[fleet]`` extra; the
TorchScript-based ``torch.onnx.export``, whose trace takes seconds where the dynamo exporter took minutes);
running needs ``onnxruntime`` only (a core dependency).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from policies.features import POINT_COLORS

ONNX_DIR = "onnx"
OPSET = 18


def graph_name(num_inference_steps: int, batch_size: int) -> str:
    """File name of the graph for a DDIM step count and batch size, e.g. ``onnx/chunk_ddim10_b1.onnx``."""
    return f"{ONNX_DIR}/chunk_ddim{int(num_inference_steps)}_b{int(batch_size)}.onnx"


def example_inputs(policy: torch.nn.Module, batch_size: int, steps: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """A valid inference batch (B = ``batch_size``) built the way deployment builds one: a fresh
    ``WindowHistory`` given ``steps`` random observations and actions (uniform in [-1, 1]; camera frames (H, W, 3)
    and point colours uint8 uniform in 0..255, as an env renders them; 0: the episode's first step, every history frame padded) and
    one more observation, then the history tokenized."""
    from policies.history import WindowHistory

    g = torch.Generator().manual_seed(seed)
    hist = WindowHistory(policy.inference_window_spec(), policy.config.action_dim)

    def frame(key, shape):
        if len(shape) == 3 or key == POINT_COLORS:   # camera frames and point colours: uint8 RGB
            return torch.randint(0, 256, (batch_size, *shape), generator=g, dtype=torch.uint8)
        return torch.rand(batch_size, *shape, generator=g) * 2 - 1

    for i in range(steps + 1):
        hist.push_obs({k: frame(k, shape) for k, shape in policy.config.input_shapes.items()})
        if i < steps:
            hist.push_action(torch.rand(batch_size, policy.config.action_dim, generator=g) * 2 - 1)
    return policy._to_device(policy.tokenize_history(hist.batch()))


def export_onnx(policy: torch.nn.Module, path: str | Path, num_inference_steps: int, batch_size: int = 1,
                optimize: bool = True, atol: float = 1e-4) -> dict[str, Any]:
    """Write the policy's chunk sampler (``chunk_graph``) at ``num_inference_steps`` and ``batch_size`` to
    ``path`` (ONNX, opset 18) and check it against the PyTorch sampler on the same inputs and noise.

    Args:
        policy: a policy with ``chunk_graph`` (the AED diffusion policy), in eval mode, on the CPU.
        num_inference_steps: DDIM steps baked into the graph (1..num_train_timesteps).
        batch_size: the graph's batch size (1 for a robot; the runtime uses PyTorch for any other).
        optimize: run ``onnxscript.optimizer.optimize`` (constant folding, dead code; about half the nodes,
            ~1.4x faster chunks; about a minute on a 2-core CPU for the default-size policy).
        atol: largest absolute difference in raw action units accepted against PyTorch.
    Returns:
        the graph's entry for ``export.json``: ``{"file", "num_inference_steps", "batch_size", "inputs",
        "opset", "max_abs_diff_vs_torch", "export_s"}`` (``file`` relative to the export folder's root).
    Raises:
        ValueError: a policy without ``chunk_graph``, a step count out of range, or a graph whose actions
            differ from PyTorch's by more than ``atol`` (nothing is left at ``path`` then).
        ImportError: ``onnx`` / ``onnxscript`` / ``onnxruntime`` missing (names the pip install).
    """
    if not hasattr(policy, "chunk_graph"):
        raise ValueError(f"policy type {getattr(policy, 'name', type(policy).__name__)!r} has no chunk graph to "
                         "export to ONNX")
    steps, B = int(num_inference_steps), int(batch_size)
    if not 1 <= steps <= policy.config.num_train_timesteps:
        raise ValueError(f"onnx num_inference_steps: expected 1..{policy.config.num_train_timesteps}, given {steps}")
    if B < 1:
        raise ValueError(f"onnx batch_size: expected >= 1, given {B}")
    try:
        import onnx
        import onnxscript
    except ImportError as e:
        raise ImportError(f"exporting ONNX needs onnx and onnxscript ({e}); pip install 'fleetmind[fleet]'") from e
    t0 = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    graph, names = policy.chunk_graph(steps)
    shape = (B, policy.config.horizon, policy.config.action_dim)
    inputs = example_inputs(policy, B, steps=2 * policy.config.horizon, seed=0)  # mid-episode: real history tokens
    args = (torch.randn(shape, generator=torch.Generator().manual_seed(0)), *(inputs[n] for n in names))
    tmp = path.with_name(f".{path.name}.tmp-{time.time_ns()}")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # the DDIM timesteps are meant to be constants of the graph: the tracer's warnings about them are not news
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            torch.onnx.export(graph, args, str(tmp), input_names=["noise", *names], output_names=["action"],
                              opset_version=OPSET, dynamo=False)
        if optimize:
            import logging

            import onnxscript.optimizer

            # one INFO line per deduplicated initializer (1,600 lines per export in a job's log under Hydra), and one
            # per node the constant folding skips (378 lines, ~75 KB, of the default job's log)
            logging.getLogger("onnx_ir").setLevel(logging.WARNING)
            logging.getLogger("onnxscript.optimizer").setLevel(logging.WARNING)
            onnx.save(onnxscript.optimizer.optimize(onnx.load(str(tmp))), str(tmp))
        sampler = OnnxChunkSampler(tmp, num_threads=1)
        diff = 0.0   # checked on inputs the trace did not see: an episode's first step and another mid-episode one
        for seed, n in ((1, 0), (2, policy.config.horizon + 3)):
            check = example_inputs(policy, B, steps=n, seed=seed)
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                ref = policy.predict_action_chunk(check, noise=noise, num_inference_steps=steps)
            diff = max(diff, float((sampler(check, noise) - ref).abs().max()))
        if not diff <= atol:
            raise ValueError(f"the ONNX chunk graph's actions differ from PyTorch's by {diff:.3g} (> atol {atol}): "
                             "not exported")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return {"num_inference_steps": steps, "batch_size": B, "inputs": sampler.input_names, "opset": OPSET,
            "max_abs_diff_vs_torch": diff, "export_s": time.perf_counter() - t0}


_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(int64)": np.int64,
               "tensor(int32)": np.int32, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


class OnnxChunkSampler:
    """An exported chunk graph in an ONNX Runtime session (CPU).

    Args:
        path: the ``.onnx`` file.
        num_threads: ONNX Runtime intra-op threads (1 on a robot computer beside its drivers).
    Call: ``sampler(inputs, noise)`` with ``inputs`` the tokenized inference windows (tensors or arrays with
    the graph's batch size) and ``noise`` (B, horizon, A) -> (B, horizon, A) float32 torch tensor of raw actions.
    Raises:
        ImportError: onnxruntime missing. KeyError: an input the graph needs is absent (names it).
    """

    def __init__(self, path: str | Path, num_threads: int = 1):
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise ImportError(f"the ONNX backend needs onnxruntime ({e}); pip install onnxruntime") from e
        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, int(num_threads))
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        # the graph's declared input dtypes: camera frames arrive as uint8 from an env but were traced as float
        self._dtypes = {i.name: _ORT_DTYPES.get(i.type) for i in self.session.get_inputs()}
        self.batch_size = int(self.session.get_inputs()[0].shape[0])

    def __call__(self, inputs: dict, noise: torch.Tensor) -> torch.Tensor:
        feed = {}
        for name in self.input_names:
            v = noise if name == "noise" else inputs.get(name)
            if v is None:
                raise KeyError(f"the ONNX chunk graph needs input {name!r}; given {sorted(inputs)}")
            a = v.detach().cpu().numpy() if torch.is_tensor(v) else np.asarray(v)
            dt = self._dtypes.get(name)
            feed[name] = a if dt is None or a.dtype == dt else a.astype(dt)
        return torch.from_numpy(self.session.run(None, feed)[0])
