"""Benchmark the AED diffusion policy: training samples/s, peak memory, and inference latency per action chunk.

    python scripts/bench_policy.py                                   # CPU (and CUDA when visible), JSON to stdout + file
    python scripts/bench_policy.py train.bench.devices=[cuda] train.bench.compile=true train.bench.batch_size=256
    python scripts/bench_policy.py 'train.bench.configs=[image]' \
        'train.bench.policy_overrides={action_patch: 4, condition_layers: 0}'   # a policy option, both AED arms

For each device and each config (``state``: the default state-only policy, ``policy=aed_diffusion``; ``image``: the
96x96-image policy, ``configs/policy/aed_diffusion_image.yaml``; ``image64``: ``experiment=vision_cpu``'s policy, the
state and one 64x64 camera; ``pointcloud``: ``experiment=pointcloud``'s, the state and a 128-point depth cloud through
DP3's encoder): training samples/s and peak memory on random batches of
the policy's windows (fused AdamW, grad clip, as ``train_policy``), CPU tokenization time per batch (the
data-path preprocessor; first sight and memoised), and the latency of one action chunk with DDIM
``num_inference_steps`` (10) at batch 1 and 32, with the per-chunk cache of the observation/prefix tokens'
denoiser states and without it (``use_cache=False``), and their ratio (CUDA: synchronised timing; optional
``torch.compile``, on CUDA ``mode="reduce-overhead"`` (CUDA graphs) for the per-step action-token pass).
Same-process baselines, timed interleaved with the AED policy: the same policy without the AED prefix
(``aed.enabled=false``, MT loss as configured: the main job's ablation arm) always, and LeRobot's
``DiffusionPolicy`` of similar parameter count when ``lerobot`` is importable.
Writes ``<output_dir>/bench_policy.json``; with ``state`` among the configs, every other config's training samples/s
and chunk latency also as a ratio to ``state``, all of them timed interleaved in one more pass (``ratio_*_vs_state``).

    python scripts/bench_policy.py 'train.bench.configs=[state,image64,pointcloud]' train.bench.devices=[cpu]
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from experience_dict.tokenizer import ActionTokenizer
from policies.aed_diffusion import AEDDiffusionConfig, AEDDiffusionPolicy

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "policy"
STATE_SHAPES = {"observation.state": [4], "observation.environment_state": [17]}


# the deployable presets' policies: (policy file, its overrides, its input shapes); experiment=vision_cpu and
# experiment=pointcloud (configs/experiment/*.yaml)
PRESETS = {
    "image64": ("aed_diffusion", {"action_patch": 1, "condition_layers": None},
                {"observation.state": [4], "observation.images.corner": [64, 64, 3]}),
    "pointcloud": ("aed_diffusion", {"point_channels": [64, 128]},
                   {"observation.state": [4], "observation.point_cloud": [128, 3]}),
}


def load_policy_cfg(name: str, image_size: int, overrides: dict | None = None,
                    shapes: dict | None = None) -> AEDDiffusionConfig:
    """A policy config file of configs/policy (defaults merged) -> AEDDiffusionConfig with Meta-World shapes
    (``shapes``: these input shapes instead)."""
    node = OmegaConf.load(CONFIG_DIR / f"{name}.yaml")
    base = OmegaConf.create()
    for d in node.pop("defaults", []) or []:
        if d != "_self_":
            base = OmegaConf.merge(base, OmegaConf.load(CONFIG_DIR / f"{d}.yaml"))
    d = OmegaConf.to_container(OmegaConf.merge(base, node, overrides or {}), resolve=True)
    d.pop("input_keys", None)
    images = d.pop("images", False)
    if shapes is None:
        shapes = dict(STATE_SHAPES)
        if images:
            shapes["observation.images.corner"] = [image_size, image_size, 3]
    return AEDDiffusionConfig.from_dict({**d, "input_shapes": shapes})


def synthetic(cfg: AEDDiffusionConfig):
    """Stats and a tokenizer fitted on smooth random actions (no store needed)."""
    rng = np.random.default_rng(0)
    t = np.arange(200)[:, None] / 80.0
    eps = [np.clip(np.sin(t * rng.uniform(1, 5, 4) + rng.uniform(0, 6, 4)), -1, 1).astype(np.float32) for _ in range(20)]
    tok = ActionTokenizer.fit(eps, r=cfg.aed.group_size, relative_dims=cfg.relative_action_dims,
                              absolute_dims=cfg.absolute_action_dims, scale=cfg.aed.tokenizer_scale,
                              vocab_size=cfg.aed.tokenizer_vocab_size)
    stats = {k: {"min": [-1.0] * v[-1], "max": [1.0] * v[-1], "mean": [0.0] * v[-1], "std": [1.0] * v[-1]}
             for k, v in cfg.input_shapes.items() if len(v) in (1, 2)}   # a point cloud: per coordinate
    stats["action"] = {"min": [-1.0] * cfg.action_dim, "max": [1.0] * cfg.action_dim,
                       "mean": [0.0] * cfg.action_dim, "std": [1.0] * cfg.action_dim}
    return stats, tok


def random_batch(policy: AEDDiffusionPolicy, B: int, spec: dict) -> dict:
    cfg, out = policy.config, {}
    for name, (key, offs) in spec.items():
        shape = [cfg.action_dim] if key == "action" else cfg.input_shapes[key]
        if len(shape) == 3:
            out[name] = torch.randint(0, 256, (B, len(offs), *shape), dtype=torch.uint8)
        else:
            out[name] = torch.rand(B, len(offs), *shape) * 2 - 1
        out[f"{name}_is_pad"] = torch.zeros(B, len(offs), dtype=torch.bool)
    return out


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(dev)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return ts


def peak_mem_mib(dev) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (Linux: KiB)


class Setup:
    """One policy on one device, with a random training batch, fused AdamW (as ``train_policy``) and inference
    batches; ``train_step()`` and ``chunk(nb, use_cache)`` are what gets timed."""

    def __init__(self, cfg: AEDDiffusionConfig, dev, bc: dict):
        stats, tok = synthetic(cfg)
        torch.manual_seed(0)
        self.policy = policy = AEDDiffusionPolicy(cfg, stats, tok).to(dev)
        self.dev, self.bc, self.B = dev, bc, bc["batch_size"]
        self.res = {"parameters": policy.num_parameters(), "ddim_steps": cfg.num_inference_steps}
        raw = random_batch(policy, self.B, policy.window_spec())
        for name in ("cold", "warm"):  # the tokenizer memoises group encodings: first sight vs seen before
            t0 = time.perf_counter()
            batch = policy.tokenize_history(raw)
            self.res[f"tokenize_ms_per_batch_{name}"] = (time.perf_counter() - t0) * 1e3
        self.batch = {k: v.to(dev) for k, v in batch.items()}
        self.opt = torch.optim.AdamW(policy.parameters(), lr=1e-4, fused=True)
        if bc["compile"]:
            policy.denoiser.compile()
            policy.obs_encoder.compile()
        self.infer = {}
        for nb in (1, 32):
            ib = policy.tokenize_history(random_batch(policy, nb, policy.inference_window_spec()))
            self.infer[nb] = ({k: v.to(dev) for k, v in ib.items()},
                              torch.randn(nb, cfg.horizon, cfg.action_dim, device=dev))

    def train_step(self):
        self.policy.train()
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.bc["amp_bf16"]):
            loss, _ = self.policy(self.batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 10.0)
        self.opt.step()

    def chunk(self, nb: int, use_cache: bool = True):
        self.policy.eval()
        ib, noise = self.infer[nb]
        return self.policy.predict_action_chunk(ib, noise=noise, use_cache=use_cache)


def bench_pair(cfgs: dict[str, AEDDiffusionConfig], dev, bc: dict, extra: dict | None = None) -> dict[str, dict]:
    """Time several policies side by side in this process: every timed iteration runs each policy once in
    turn (so load from other processes hits all alike); medians. Per policy: training samples/s, step ms,
    and the latency of one action chunk (DDIM ``num_inference_steps``) at batch 1 and 32, with the per-chunk
    cache of the obs/prefix tokens' denoiser states (default) and without it (whole masked sequence every
    step), and their ratio."""
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(dev)
    log_skip: dict[str, str] = {}
    setups = {name: Setup(cfg, dev, bc) for name, cfg in cfgs.items()}
    for name, make in (extra or {}).items():  # e.g. LeRobot's DiffusionPolicy, sized to match the first policy
        try:
            setups[name] = make(next(iter(setups.values())).res["parameters"])
        except Exception as e:  # noqa: BLE001 - a baseline that cannot be built is reported, not fatal
            log_skip[name] = f"not run: {type(e).__name__}: {e}"
    if bc["compile"] and dev.type == "cuda":  # CUDA graphs for the per-step action-token pass
        for st in setups.values():
            if isinstance(st, Setup):
                st.policy.denoiser.denoise = torch.compile(st.policy.denoiser.denoise, mode="reduce-overhead")
    jobs = {"train": lambda st: st.train_step()}

    for nb in (1, 32):
        jobs[f"chunk_b{nb}"] = lambda st, nb=nb: st.chunk(nb)
        jobs[f"chunk_b{nb}_uncached"] = lambda st, nb=nb: st.chunk(nb, use_cache=False)
    times = {name: {job: [] for job in jobs} for name in setups}
    for job, fn in jobs.items():
        iters = bc["train_iters"] if job == "train" else bc["infer_iters"]
        for it in range(bc["warmup"] + iters):
            for name, st in setups.items():
                sync(dev)
                t0 = time.perf_counter()
                fn(st)
                sync(dev)
                if it >= bc["warmup"]:
                    times[name][job].append(time.perf_counter() - t0)
    out = {}
    for name, st in setups.items():
        r, med = st.res, {job: float(np.median(ts)) for job, ts in times[name].items()}
        r["train_samples_per_s"] = st.B / med["train"]
        r["train_step_ms"] = med["train"] * 1e3
        if isinstance(st, LeRobotSetup):  # no per-chunk cache there: the uncached runs time the same thing
            for nb in (1, 32):
                r[f"chunk_latency_ms_b{nb}"] = float(np.median(times[name][f"chunk_b{nb}"]
                                                               + times[name][f"chunk_b{nb}_uncached"])) * 1e3
            out[name] = r
            continue
        for nb in (1, 32):
            r[f"chunk_latency_ms_b{nb}"] = med[f"chunk_b{nb}"] * 1e3
            r[f"chunk_latency_ms_b{nb}_uncached"] = med[f"chunk_b{nb}_uncached"] * 1e3
            r[f"ratio_chunk_latency_cached_vs_uncached_b{nb}"] = med[f"chunk_b{nb}"] / med[f"chunk_b{nb}_uncached"]
        out[name] = r
    peak = peak_mem_mib(dev)  # process-wide (CPU: peak RSS; CUDA: all policies of this pair)
    for r in out.values():
        r["peak_memory_mib"] = peak
    out.update(log_skip)
    return out


class LeRobotSetup:
    """LeRobot 0.6.1's ``DiffusionPolicy`` (U-Net denoiser, DDIM ``num_inference_steps`` 10, horizon 16, 2 obs
    steps) on the same batch size and shapes, with the ``down_dims`` of ``candidates`` whose parameter count is
    closest to ``match_params``; same ``train_step()`` / ``chunk(nb)`` interface as :class:`Setup` so
    :func:`bench_pair` times it interleaved with ours. Raises ImportError when lerobot is not installed."""

    def __init__(self, dev, bc: dict, image_size: int | None, match_params: int):
        from lerobot.configs.types import FeatureType, PolicyFeature
        from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
        from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

        feats = {"observation.state": PolicyFeature(FeatureType.STATE, (4,)),
                 "observation.environment_state": PolicyFeature(FeatureType.ENV, (17,))}
        if image_size:
            feats["observation.images.corner"] = PolicyFeature(FeatureType.VISUAL, (3, image_size, image_size))

        def make(dims):
            cfg = DiffusionConfig(input_features=feats,
                                  output_features={"action": PolicyFeature(FeatureType.ACTION, (4,))},
                                  horizon=16, n_obs_steps=2, n_action_steps=8, down_dims=tuple(dims),
                                  crop_shape=None, num_inference_steps=10, noise_scheduler_type="DDIM",
                                  pretrained_backbone_weights=None)  # from scratch, as ours; never a download
            torch.manual_seed(0)
            return DiffusionPolicy(cfg)

        counts = {}
        for dims in bc["lerobot_down_dims"]:
            counts[tuple(dims)] = sum(p.numel() for p in make(dims).parameters())
        dims = min(counts, key=lambda d: abs(np.log(counts[d] / match_params)))
        self.policy = make(dims).to(dev)
        self.dev, self.B, self.image = dev, bc["batch_size"], bool(image_size)
        self.res = {"parameters": counts[dims], "down_dims": list(dims), "ddim_steps": 10,
                    "candidates_parameters": {str(list(k)): v for k, v in counts.items()}}

        def batch(n):
            b = {"observation.state": torch.randn(n, 2, 4), "observation.environment_state": torch.randn(n, 2, 17),
                 "action": torch.randn(n, 16, 4), "action_is_pad": torch.zeros(n, 16, dtype=torch.bool)}
            if image_size:
                b["observation.images.corner"] = torch.rand(n, 2, 3, image_size, image_size)
            return {k: v.to(dev) for k, v in b.items()}

        self.batch = batch(self.B)
        self.infer = {}
        for nb in (1, 32):
            ib = batch(nb)
            if image_size:  # what DiffusionPolicy.forward/select_action stack before the model
                ib["observation.images"] = torch.stack([ib["observation.images.corner"]], dim=-4)
            self.infer[nb] = ib
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=1e-4, fused=True)
        self.amp_bf16 = bool(bc["amp_bf16"])
        if bc["compile"]:  # the same treatment as ours: torch.compile of the denoiser (its U-Net)
            self.policy.diffusion.unet.compile()

    def train_step(self):
        self.policy.train()
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp_bf16):
            loss, _ = self.policy.forward(dict(self.batch))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 10.0)
        self.opt.step()

    @torch.no_grad()
    def chunk(self, nb: int, use_cache: bool = True):
        self.policy.eval()
        return self.policy.diffusion.generate_actions(self.infer[nb])


def config_of(cname: str, cfg: DictConfig, bc: dict, aed: bool = True) -> AEDDiffusionConfig:
    """The benchmarked policy config ``cname`` (``state``, ``image``, or a :data:`PRESETS` name), with
    ``train.bench.policy_overrides`` and, ``aed=False``, the AED prefix off."""
    pol = "aed_diffusion_image" if cname == "image" else "aed_diffusion"
    over = dict(bc.get("policy_overrides") or {})  # e.g. {action_patch: 4, condition_layers: 0}
    shapes = None
    if cname in PRESETS:
        pol, pre, shapes = PRESETS[cname]
        over = {**pre, **over}
    if not aed:
        over = {**over, "aed": {"enabled": False}}
    return load_policy_cfg(pol, int(cfg.obs.image_size), over, shapes)


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    bc = OmegaConf.to_container(cfg.train.bench, resolve=True)
    if bc["num_threads"]:
        torch.set_num_threads(int(bc["num_threads"]))
    devices = [d for d in bc["devices"] if d == "cpu" or torch.cuda.is_available()]
    out = {"torch": torch.__version__, "host": platform.node(), "cpu_threads": torch.get_num_threads(),
           "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "settings": bc,
           "results": {}}
    for dname in devices:
        dev = torch.device(dname)
        for cname in bc["configs"]:
            size = int(cfg.obs.image_size)
            img = size if cname == "image" else (64 if cname == "image64" else None)
            extra = {} if cname == "pointcloud" else {   # LeRobot's DiffusionPolicy has no point-cloud encoder
                "lerobot_diffusion": lambda n, img=img, dev=dev: LeRobotSetup(dev, bc, img, n)}
            pair = bench_pair({"aed": config_of(cname, cfg, bc), "no_aed": config_of(cname, cfg, bc, aed=False)},
                              dev, bc, extra=extra)
            r = pair["aed"]
            r["baseline_no_aed"] = pair["no_aed"]
            r["ratio_train_samples_per_s_vs_no_aed"] = r["train_samples_per_s"] / pair["no_aed"]["train_samples_per_s"]
            r["lerobot_diffusion"] = lr_res = pair.get("lerobot_diffusion", "no LeRobot equivalent")
            if isinstance(lr_res, dict):
                r["ratio_train_samples_per_s_vs_lerobot"] = r["train_samples_per_s"] / lr_res["train_samples_per_s"]
                for nb in (1, 32):
                    r[f"ratio_chunk_latency_vs_lerobot_b{nb}"] = (r[f"chunk_latency_ms_b{nb}"]
                                                                  / lr_res[f"chunk_latency_ms_b{nb}"])
            out["results"][f"{dname}/{cname}"] = r
            print(json.dumps({f"{dname}/{cname}": r}), flush=True)
        others = [c for c in bc["configs"] if c != "state"]
        if "state" in bc["configs"] and others:   # every config against the state policy, timed interleaved
            trio = bench_pair({c: config_of(c, cfg, bc) for c in ["state", *others]}, dev, bc)
            base = trio["state"]
            for cname in others:
                r, t = out["results"][f"{dname}/{cname}"], trio[cname]
                r["ratio_train_samples_per_s_vs_state"] = t["train_samples_per_s"] / base["train_samples_per_s"]
                for nb in (1, 32):
                    r[f"ratio_chunk_latency_vs_state_b{nb}"] = (t[f"chunk_latency_ms_b{nb}"]
                                                                 / base[f"chunk_latency_ms_b{nb}"])
    out["load_average_1_5_15"] = list(os.getloadavg())  # other processes' load during the run (noisy machines)
    path = Path(cfg.output_dir) / "bench_policy.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
