"""Training the AED diffusion policy: one training step, EMA, resumable checkpoints, and the loop
``train_policy`` that ``scripts/train.py`` and the fleet learner call.

Checkpoint layout (no pickle anywhere: tensors in safetensors, everything else JSON)::

    <out_dir>/checkpoints/<step:07d>/pretrained_model/   # save_pretrained of the EMA policy (what gets deployed)
    <out_dir>/checkpoints/<step:07d>/training_state/     # model.safetensors (live weights), ema.safetensors,
                                                         # optimizer.safetensors + optimizer.json, state.json
    <out_dir>/checkpoints/last.json                      # {"step", "path"} of the newest complete checkpoint
    <out_dir>/metrics.jsonl                              # one JSON line per log step

A checkpoint directory is written under a temporary name and renamed when complete, then ``last.json`` is
replaced atomically, so an interrupted run resumes from the last complete checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset, default_collate

from experience_dict.atomic import atomic_dir, atomic_write_text
from experience_dict.tokenizer import ActionTokenizer
from policies.aed_diffusion.configuration_aed_diffusion import AEDDiffusionConfig
from policies.aed_diffusion.modeling_aed_diffusion import AEDDiffusionPolicy, build_policy
from policies.train_config import TrainConfig

log = logging.getLogger(__name__)



# ----------------------------------------------------------------------------- EMA
class EMA:
    """Exponential moving average of a policy's weights with Diffusion Policy's warm-up schedule
    (Chi et al. 2023, ``diffusion_policy/model/diffusion/ema_model.py``):
    ``decay = clamp(1 - (1 + step) ** -power, 0, max_decay)``. ``self.model`` is the averaged copy.
    """

    def __init__(self, model: torch.nn.Module, power: float = 0.75, max_decay: float = 0.9999):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.power, self.max_decay, self.step_count = power, max_decay, 0

    def decay(self) -> float:
        return float(min(self.max_decay, max(0.0, 1.0 - (1.0 + self.step_count) ** -self.power)))

    @torch.no_grad()
    def step(self, model: torch.nn.Module) -> None:
        d = self.decay()
        ema_p = [p for p in self.model.parameters()]
        src_p = [p for p in model.parameters()]
        torch._foreach_lerp_(ema_p, [p.detach() for p in src_p], 1.0 - d)
        for eb, b in zip(self.model.buffers(), model.buffers()):
            eb.copy_(b)
        self.step_count += 1


class WarmupCosine:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total`` steps."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = int(warmup), int(total)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / max(1, self.warmup)
        frac = (step - self.warmup) / max(1, self.total - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


class TokenizingCollate:
    """``default_collate`` (skipped when given an already collated batch dict, e.g. from
    ``WindowDataset.fetch``) then the policy's CPU preprocessor (AED history tokenization), so tokenization
    runs in DataLoader workers. Picklable."""

    def __init__(self, tokenizer: ActionTokenizer | None):
        self.tokenizer = tokenizer

    def __call__(self, items):
        batch = items if isinstance(items, dict) else default_collate(items)
        if self.tokenizer is not None and "history.action" in batch:
            pad = batch.get("history.action_is_pad")
            out = self.tokenizer.encode_history(batch["history.action"].numpy(),
                                                None if pad is None else pad.numpy())
            batch["history.tokens"] = torch.from_numpy(out["tokens"])
            batch["history.token_mask"] = torch.from_numpy(out["token_mask"])
            batch["history.group_mask"] = torch.from_numpy(out["group_mask"])
        return batch


# ----------------------------------------------------------------------------- optimizer state <-> files
def save_optimizer(opt: torch.optim.Optimizer, directory: Path) -> None:
    """Tensors of ``opt.state_dict()`` to ``optimizer.safetensors``, the rest (structure) to ``optimizer.json``."""
    sd = opt.state_dict()
    tensors, state = {}, {}
    for pid, st in sd["state"].items():
        state[str(pid)] = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.detach().cpu().contiguous()
                state[str(pid)][k] = {"tensor": f"{pid}.{k}"}
            else:
                state[str(pid)][k] = {"value": v}
    save_file(tensors, str(directory / "optimizer.safetensors"))
    (directory / "optimizer.json").write_text(json.dumps({"state": state, "param_groups": sd["param_groups"]}))


def load_optimizer(opt: torch.optim.Optimizer, directory: Path) -> None:
    """Inverse of ``save_optimizer``."""
    meta = json.loads((directory / "optimizer.json").read_text())
    tensors = load_file(str(directory / "optimizer.safetensors"))
    state = {int(pid): {k: (tensors[v["tensor"]] if "tensor" in v else v["value"]) for k, v in st.items()}
             for pid, st in meta["state"].items()}
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(out_dir: Path, step: int, policy: AEDDiffusionPolicy, ema: EMA | None,
                    opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR) -> Path:
    """Write ``checkpoints/<step>`` atomically and point ``last.json`` at it; returns the pretrained_model dir."""
    ckpt_root = out_dir / "checkpoints"
    final = ckpt_root / f"{step:07d}"
    with atomic_dir(final) as tmp:
        (ema.model if ema is not None else policy).save_pretrained(tmp / "pretrained_model")
        ts = tmp / "training_state"
        ts.mkdir(parents=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()},
                  str(ts / "model.safetensors"))
        if ema is not None:
            save_file({k: v.detach().cpu().contiguous() for k, v in ema.model.state_dict().items()},
                      str(ts / "ema.safetensors"))
        save_optimizer(opt, ts)
        (ts / "state.json").write_text(json.dumps({
            "step": step, "ema_step": ema.step_count if ema is not None else None,
            "scheduler": {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}}))
    atomic_write_text(ckpt_root / "last.json", json.dumps({"step": step, "path": final.name}))
    return final / "pretrained_model"


def last_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory under ``out_dir/checkpoints`` or None."""
    f = Path(out_dir) / "checkpoints" / "last.json"
    if not f.is_file():
        return None
    p = f.parent / json.loads(f.read_text())["path"]
    return p if p.is_dir() else None


# ----------------------------------------------------------------------------- the loop
def resolve_device(device: str | None) -> torch.device:
    """"auto"/None -> cuda when available else cpu; otherwise ``torch.device(device)``."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class StepBatchSampler(torch.utils.data.Sampler):
    """Batches of dataset indices as a pure function of ``(seed, step)``, so that a resumed run sees exactly the
    batches an uninterrupted one would (no sampler state to save).

    Step ``s`` is batch ``s mod nb`` of epoch ``s // nb`` (``nb = n // batch_size`` with ``drop_last``, else
    ``ceil(n / batch_size)``, at least 1); epoch ``e`` is the permutation ``numpy.random.default_rng([seed, e])``
    of ``range(n)``. Iterating yields the batches of steps ``start .. stop - 1`` (lists of int).

    Raises:
        ValueError: ``n < 1``, ``batch_size < 1`` or ``stop < start``.
    """

    def __init__(self, n: int, batch_size: int, seed: int, start: int, stop: int, drop_last: bool = True):
        if n < 1 or batch_size < 1 or stop < start:
            raise ValueError(f"StepBatchSampler: n >= 1, batch_size >= 1, stop >= start expected, given n={n}, "
                             f"batch_size={batch_size}, start={start}, stop={stop}")
        self.n, self.batch_size, self.seed, self.start, self.stop = int(n), int(batch_size), int(seed), start, stop
        self.per_epoch = max(1, self.n // self.batch_size if drop_last else -(-self.n // self.batch_size))
        self._perm: tuple[int, np.ndarray] | None = None

    def batch(self, step: int) -> list[int]:
        """The dataset indices of training step ``step`` (0-based)."""
        e, i = divmod(int(step), self.per_epoch)
        if self._perm is None or self._perm[0] != e:
            self._perm = (e, np.random.default_rng([self.seed, e]).permutation(self.n))
        return self._perm[1][i * self.batch_size:(i + 1) * self.batch_size].tolist()

    def __iter__(self):
        for s in range(self.start, self.stop):
            yield self.batch(s)

    def __len__(self) -> int:
        return self.stop - self.start


def step_seed(seed: int, step: int) -> int:
    """The torch seed of training step ``step`` (diffusion noise, timesteps, dropout): a function of
    ``(seed, step)`` only, so a resumed run draws what an uninterrupted one would."""
    return int(np.random.default_rng([int(seed), 7, int(step)]).integers(2 ** 62))


def train_policy(train_cfg: dict, out_dir: str | Path, *, policy: Any | None = None,
                 policy_cfg: AEDDiffusionConfig | dict | None = None, reader=None, episodes=None,
                 dataset: Dataset | None = None, device: str | None = "auto",
                 run_config: dict | None = None, val_dataset: Dataset | None = None) -> dict:
    """Train (or keep training) a policy; resumable.

    Any policy implementing ``policies.base.Policy`` trains here (the AED diffusion policy, the MLP chunk
    policy, ...). Give either ``policy`` (fine-tune an existing one) or ``policy_cfg`` + ``reader`` +
    ``episodes`` (fit the tokenizer and stats on those episodes, build a fresh policy): an
    ``AEDDiffusionConfig``, or a Hydra ``policy`` node dict whose ``type`` picks the class
    (``policies.factory.make_policy``). The data is ``dataset`` if given (any
    Dataset of window dicts with ``policy.window_spec()``'s names, e.g. FERT retrieval mixed with demo
    replay), else ``WindowDataset(reader, episodes, policy.window_spec())``. If ``train_cfg["resume"]`` and
    ``out_dir`` holds a checkpoint, everything (weights, EMA, optimizer, LR schedule, step) resumes from it.

    Args:
        train_cfg: a :class:`policies.train_config.TrainConfig` or a mapping of its keys (missing keys take its
            defaults; an unknown key or a value out of range raises ``configs.rules.ConfigError``).
        out_dir: run directory (checkpoints, metrics.jsonl, wandb).
        device: "auto" | "cpu" | "cuda" | ...
        run_config: extra JSON-able config logged to wandb.
        val_dataset: optional held-out windows (e.g. demonstrations kept apart), or ``f(policy) -> Dataset``
            (built once the policy exists, for its window spec): at every checkpoint the
            saved (EMA) policy's loss on up to ``val_batches`` fixed batches of it is logged as ``val_loss``
            (the noise and timesteps are drawn from a fixed seed, so the curve compares checkpoints, not draws).
    Returns:
        {"step", "checkpoint" (pretrained_model dir of the last checkpoint), "metrics" (last logged),
         "samples_per_s", "policy" (the EMA policy, eval mode), "val_curve" ([{"step", "val_loss",
         "checkpoint"}] of this call's checkpoints; empty without ``val_dataset``)}.
    Raises:
        ValueError: neither ``policy`` nor ``policy_cfg``/``reader``/``episodes`` given, or no episodes.
    """
    tc = TrainConfig.from_dict(train_cfg).to_dict()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = resolve_device(device)
    from policies.threads import apply_thread_budget

    apply_thread_budget(int(tc["num_threads"]) if tc["num_threads"] else None)   # null: the CPUs this process may use
    torch.manual_seed(tc["seed"])
    np.random.seed(tc["seed"])

    resume_from = last_checkpoint(out_dir) if tc["resume"] else None
    if resume_from is not None:
        from policies.factory import load_policy

        policy = load_policy(resume_from / "pretrained_model")
        log.info("resuming from %s", resume_from)
    elif policy is None:
        if policy_cfg is None or reader is None or not episodes:
            raise ValueError("train_policy needs policy=..., or policy_cfg, reader and a non-empty episodes list")
        if isinstance(policy_cfg, AEDDiffusionConfig):
            policy = build_policy(policy_cfg, reader, episodes)
        else:
            from policies.factory import make_policy

            policy = make_policy(policy_cfg, reader, episodes)
    policy = policy.to(dev).train()
    if dataset is None:
        if reader is None or not episodes:
            raise ValueError("train_policy needs dataset=..., or reader and a non-empty episodes list")
        from experience_dict.sampler import WindowDataset
        dataset = WindowDataset(reader, episodes, windows=policy.window_spec())

    params = [p for p in policy.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc["lr"], betas=tuple(tc["betas"]),
                            fused=True)  # one fused kernel per step (CPU too: ~4x faster than foreach here)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(tc["warmup_steps"], tc["steps"]))
    ema = EMA(policy, tc["ema_power"], tc["ema_max_decay"]) if tc["ema"] else None
    step = 0
    if resume_from is not None:
        ts = resume_from / "training_state"
        policy.load_weights(ts / "model.safetensors")
        if ema is not None and (ts / "ema.safetensors").is_file():
            ema.model.load_weights(ts / "ema.safetensors")
        load_optimizer(opt, ts)
        st = json.loads((ts / "state.json").read_text())
        # the LR lambda is rebuilt from this run's config (a longer run stretches the cosine); its counters resume
        sched.load_state_dict({**st["scheduler"], "lr_lambdas": [None] * len(opt.param_groups)})
        step = int(st["step"])
        if ema is not None and st.get("ema_step") is not None:
            ema.step_count = int(st["ema_step"])
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if tc["compile"]:
        for m in getattr(policy, "compile_modules", lambda: [policy])():   # AED: denoiser and observation encoder
            m.compile()

    drop_last = len(dataset) >= tc["batch_size"]
    # batches and per-step noise are functions of (seed, step): a resumed run continues exactly where it stopped
    steps_sampler = StepBatchSampler(len(dataset), tc["batch_size"], tc["seed"], step, max(step, tc["steps"]), drop_last)
    if callable(getattr(dataset, "fetch", None)):  # WindowDataset: one vectorised read per batch, no per-item collate
        batching = {"sampler": steps_sampler, "batch_size": None}
    else:
        batching = {"batch_sampler": steps_sampler}
    loader = DataLoader(dataset, **batching, num_workers=tc["num_workers"], collate_fn=TokenizingCollate(getattr(policy, "tokenizer", None)),
                        pin_memory=dev.type == "cuda", persistent_workers=tc["num_workers"] > 0)
    wb = None
    if tc["wandb"]["enabled"]:
        import wandb
        wb = wandb.init(project=tc["wandb"]["project"], name=tc["wandb"]["name"], mode=tc["wandb"]["mode"],
                        dir=str(out_dir), config={"train": tc, "policy": policy.config.to_dict(), **(run_config or {})},
                        resume="allow", id=hashlib.sha1(str(out_dir.resolve()).encode()).hexdigest()[:12])
    metrics_f = open(out_dir / "metrics.jsonl", "a")  # noqa: SIM115 (kept open across the loop, closed below)
    log.info("training %s params on %s for %d steps (from step %d)", f"{policy.num_parameters():,}", dev,
             tc["steps"], step)
    from tqdm import tqdm
    bar = tqdm(total=tc["steps"], initial=step, disable=not tc["progress"], desc=str(tc["desc"]), dynamic_ncols=True)
    batches = iter(loader)
    last_metrics, ckpt = {}, None
    val_curve: list[dict] = []
    val_batches = None
    if callable(val_dataset) and not isinstance(val_dataset, Dataset):
        val_dataset = val_dataset(policy)
    if val_dataset is not None and len(val_dataset):
        g = torch.Generator().manual_seed(0)
        order = torch.randperm(len(val_dataset), generator=g).tolist()
        B = int(tc["batch_size"])
        collate = TokenizingCollate(getattr(policy, "tokenizer", None))
        fetch = getattr(val_dataset, "fetch", None)
        val_batches = [collate(fetch(order[i:i + B]) if callable(fetch) else [val_dataset[j] for j in order[i:i + B]])
                       for i in range(0, min(len(order), B * int(tc["val_batches"])), B)]
    t_log, n_log = time.perf_counter(), 0
    sps = 0.0
    while step < tc["steps"]:
        batch = next(batches)
        torch.manual_seed(step_seed(tc["seed"], step))
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=tc["amp_bf16"]):
            loss, m = policy(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, tc["grad_clip"])
        opt.step()
        sched.step()
        if ema is not None:
            ema.step(policy)
        step += 1
        n_log += batch["action"].shape[0]
        bar.update(1)
        if step % tc["log_every"] == 0 or step == tc["steps"]:
            now = time.perf_counter()
            sps = n_log / max(now - t_log, 1e-9)
            last_metrics = {"step": step, **m, "grad_norm": float(gn), "lr": sched.get_last_lr()[0],
                            "samples_per_s": sps, "time": time.time()}
            metrics_f.write(json.dumps(last_metrics) + "\n")
            metrics_f.flush()
            if wb is not None:
                wb.log(last_metrics, step=step)
            bar.set_postfix(loss=f"{m['loss']:.4f}", sps=f"{sps:.0f}", refresh=False)  # the bar's own interval
            t_log, n_log = now, 0
        if step % tc["save_every"] == 0 or step == tc["steps"]:
            ckpt = save_checkpoint(out_dir, step, policy, ema, opt, sched)
            if val_batches:
                vl = validation_loss(ema.model if ema is not None else policy, val_batches, dev)
                val_curve.append({"step": step, "val_loss": vl, "checkpoint": str(ckpt)})
                metrics_f.write(json.dumps({"step": step, "val_loss": vl, "time": time.time()}) + "\n")
                metrics_f.flush()
                if wb is not None:
                    wb.log({"val_loss": vl}, step=step)
                policy.train()
    bar.close()
    metrics_f.close()
    if wb is not None:
        wb.finish()
    if ckpt is None:
        last = last_checkpoint(out_dir)
        ckpt = last / "pretrained_model" if last is not None else save_checkpoint(out_dir, step, policy, ema, opt, sched)
    final = (ema.model if ema is not None else policy).eval()
    return {"step": step, "checkpoint": ckpt, "metrics": last_metrics, "samples_per_s": sps, "policy": final,
            "val_curve": val_curve}


@torch.no_grad()
def validation_loss(model: AEDDiffusionPolicy, batches: list[dict], device) -> float:
    """Mean training loss of ``model`` over ``batches`` with a fixed RNG (noise, timesteps), in eval mode;
    the global RNG state is restored afterwards, so training continues on its own stream."""
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12345)
        losses = []
        for b in batches:
            b = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()}
            losses.append(float(model(b)[0]))
    model.train(was_training)
    return float(np.mean(losses))
