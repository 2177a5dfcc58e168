"""Latency of the lean runtime (``policies.runtime``) per action chunk: CPU at 1 and 2 threads, and CUDA.

    python scripts/bench_runtime.py                                   # fresh default-size policy
    python scripts/bench_runtime.py deploy.bench.export_dir=exports/push deploy.bench.threads=[1]

For each device / thread count / DDIM step count: median and p90 milliseconds of one action chunk at batch 1
(``PolicyRuntime.predict_action_chunk`` on the policy's inference windows), beside a same-process baseline: the
training-side ``AEDDiffusionPolicy.from_pretrained`` on the checkpoint the export was made from (ratio ~1: the
runtime adds no work). With ``deploy.bench.onnx`` also the runtime's ONNX backend (``policies.onnx``: the chunk
graph in ONNX Runtime, exported into the folder if it lacks one) against the same baseline, and its action
difference. Also the cold import + load time of the runtime in a fresh interpreter and whether it
pulled in Ray / MuJoCo / Hydra / wandb, and the 1-minute load average (timings on a shared CPU are noisy). Without ``deploy.bench.export_dir`` a default-size
``policy=aed_diffusion`` (Meta-World shapes, synthetic stats and tokenizer; untrained weights, same latency) is
saved and exported to a temporary folder. Writes JSON to ``deploy.bench.out``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes

REPO = Path(__file__).resolve().parents[1]

from policies.aed_diffusion import AEDDiffusionPolicy
from policies.export import export_checkpoint
from policies.runtime import PolicyRuntime, sha256_file
from scripts.bench_policy import load_policy_cfg, random_batch, synthetic

HEAVY = ("ray", "mujoco", "hydra", "wandb", "metaworld", "zarr", "gymnasium", "sim", "fleet")


def cold_start(export_dir: Path) -> dict:
    """In a fresh interpreter: seconds to import ``policies.runtime`` and to load the export, and which heavy
    packages (and whether diffusers) were imported by then."""
    code = ("import sys, time, json; t = time.perf_counter(); from policies.runtime import PolicyRuntime\n"
            "t1 = time.perf_counter(); PolicyRuntime.load(sys.argv[1]); t2 = time.perf_counter()\n"
            f"print(json.dumps({{'import_s': t1 - t, 'load_s': t2 - t1, 'heavy_modules': sorted({{m.split('.')[0] "
            f"for m in sys.modules}} & set({list(HEAVY)!r})), 'diffusers_imported': 'diffusers' in sys.modules}}))")
    out = subprocess.run([sys.executable, "-c", code, str(export_dir)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_actions(rt: PolicyRuntime, base: AEDDiffusionPolicy, batch: dict, dev: torch.device) -> dict:
    """The runtime's first chunk (seconds; a compiled runtime compiles here) and its largest absolute difference
    from the training policy's chunk on the same initial noise (actions in [-1, 1])."""
    noise = torch.randn(1, base.config.horizon, base.config.action_dim, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    a = rt.predict_action_chunk(batch, noise=noise.to(dev))
    first_s = time.perf_counter() - t0
    with torch.no_grad():
        b = base.predict_action_chunk(batch, noise=noise.to(dev))
    return {"first_chunk_s": first_s, "max_abs_diff_vs_training_policy": float((a - b).abs().max())}


def time_chunks(fn, n: int, dev: torch.device) -> dict:
    for _ in range(10):   # warm-up (allocator, caches; the first timed block of a process ran ~30% slow after 3)
        fn()
    ts = []
    for _ in range(n):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": float(np.median(ts)), "p90_ms": float(np.percentile(ts, 90)), "n": n}


def time_onnx(export_dir: Path, base: AEDDiffusionPolicy, batch: dict, steps: int, threads: int, n: int) -> dict:
    """The runtime on its ONNX backend (``policies.onnx``; the graph exported into ``export_dir/onnx`` at ``steps``
    if the export lacks it, export time reported), timed beside the training policy in PyTorch on the same
    thread count, and the largest action difference between the two on the same noise."""
    from policies.onnx import export_onnx, graph_name

    meta_path = export_dir / "export.json"
    meta = json.loads(meta_path.read_text())
    export_s = None
    if not any(g["num_inference_steps"] == steps and g["batch_size"] == 1 for g in meta.get("onnx", [])):
        rel = graph_name(steps, 1)
        g = {"file": rel, **export_onnx(base, export_dir / rel, steps, 1)}
        export_s = g["export_s"]
        meta.setdefault("onnx", []).append(g)
        meta["files"][rel] = sha256_file(export_dir / rel)
        meta_path.write_text(json.dumps(meta, indent=1))
    torch.set_num_threads(threads)
    rt = PolicyRuntime.load(export_dir, num_threads=threads, backend="onnx", num_inference_steps=steps)
    noise = torch.randn(1, base.config.horizon, base.config.action_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = float((rt.predict_action_chunk(batch, noise=noise) - base.predict_action_chunk(
            batch, noise=noise, num_inference_steps=steps)).abs().max())
    gen = torch.Generator().manual_seed(0)
    r = time_chunks(partial(rt.predict_action_chunk, batch, generator=gen), n, torch.device("cpu"))
    b = time_chunks(partial(base.predict_action_chunk, batch, generator=gen, num_inference_steps=steps), n,
                    torch.device("cpu"))
    return {**r, "baseline_training_policy_median_ms": b["median_ms"], "ratio_vs_training_policy": r["median_ms"] /
            b["median_ms"], "speedup_vs_training_policy": b["median_ms"] / r["median_ms"],
            "max_abs_diff_vs_training_policy": diff, "export_s": export_s}


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    if "deploy" not in cfg:
        raise SystemExit("compose the deploy group: python scripts/bench_runtime.py")
    from fleet.deploy.config import BenchConfig

    bc = BenchConfig.from_dict(cfg.deploy.bench).to_dict()
    tmp = tempfile.TemporaryDirectory()
    export_dir = bc["export_dir"]
    if export_dir is None:
        pcfg = load_policy_cfg("aed_diffusion", 96)
        stats, tok = synthetic(pcfg)
        torch.manual_seed(0)
        AEDDiffusionPolicy(pcfg, stats, tok).save_pretrained(Path(tmp.name) / "ckpt")
        export_dir = export_checkpoint(Path(tmp.name) / "ckpt", Path(tmp.name) / "export", control_hz=80.0)
    export_dir = Path(export_dir)
    source = json.loads((export_dir / "export.json").read_text())["source"]["path"]
    out = {"export_dir": str(export_dir), "host": platform.node(), "cpu_count": os.cpu_count(),
           "torch": torch.__version__, "cold_start": cold_start(export_dir),
           "loadavg_1min_before": os.getloadavg()[0], "results": {}}
    for dname in bc["devices"]:
        if dname == "cuda" and not torch.cuda.is_available():
            continue
        dev = torch.device(dname)
        base = AEDDiffusionPolicy.from_pretrained(source if Path(source).is_dir() else export_dir, device=dev)
        for compiled in bc.get("compile", [False]):
            rt = PolicyRuntime.load(export_dir, device=dev, compile=bool(compiled), backend="torch")
            out["parameters"] = rt.policy.num_parameters()
            batch = random_batch(rt.policy, 1, rt.inference_window_spec())
            first = same_actions(rt, base, batch, dev)   # also compiles (compiled runtime): its time is reported
            for threads in (bc["threads"] if dname == "cpu" else [torch.get_num_threads()]):
                torch.set_num_threads(int(threads))
                for steps in bc["num_inference_steps"]:
                    gen = torch.Generator(device=dev).manual_seed(0)
                    r = time_chunks(partial(rt.predict_action_chunk, batch, generator=gen, num_inference_steps=steps),
                                    bc["chunks"], dev)
                    b = time_chunks(partial(base.predict_action_chunk, batch, generator=gen, num_inference_steps=steps),
                                    bc["chunks"], dev)
                    r["baseline_training_policy_median_ms"] = b["median_ms"]
                    r["ratio_vs_training_policy"] = r["median_ms"] / b["median_ms"]
                    r.update(first)
                    key = (f"{dname}/threads={threads}/ddim_steps={steps}" if dname == "cpu" else
                           f"{dname}/ddim_steps={steps}") + ("/compiled" if compiled else "")
                    out["results"][key] = r
                    print(json.dumps({key: r}), flush=True)
                    if bc.get("onnx") and dname == "cpu" and not compiled:
                        key = f"{dname}/threads={threads}/ddim_steps={steps}/onnx"
                        out["results"][key] = r = time_onnx(export_dir, base, batch, steps, int(threads), bc["chunks"])
                        print(json.dumps({key: r}), flush=True)
    out["loadavg_1min_after"] = os.getloadavg()[0]  # the CPU may be shared: a load above cpu_count skews timings
    path = Path(bc["out"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    tmp.cleanup()


if __name__ == "__main__":
    main()
