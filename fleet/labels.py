"""The fleet's success labels as a deployment gets them, and recovery from the failure state.

A real fleet has neither a simulator's success oracle nor a way to put the world back where a failed trial started.
This module gives the vectorised fleet (``fleet.experiment.evaluation.run_plan_vectorised``) what it has instead
(``experiment=deployed``; docs/FLEET_LEARNING.md, "The deployed preset"):

* :class:`Acting`: how a plan's trials are labelled and continued: ``source`` ``"human"`` (the labelled budget:
  the simulator's verdict and success moment stand in for a person's, and frames are recorded for the detector),
  ``"detector"`` (the learned detector judges every ``labels.every`` steps, ends the episode
  ``task.steps_after_success`` steps after it fires, and its verdict is the episode's ``success``) or ``"sim"``; and
  ``recovery``: a failure is followed at once by recovery attempts that continue from the state where it ended.
* :class:`OnlineLabeller`: the detector's frames (``sim.gl.FrameGrabber``: the unit's own cameras, shared GL
  contexts), the firing rule and the frame recording.
* :func:`fit_from_records`: the detector's fit on the labelled budget, its threshold chosen on held-out labelled
  episodes; :func:`label_audit`: its labels against the simulator's (precision, recall).

Every episode committed under an :class:`Acting` carries ``extra.label`` (``source``, ``fired_at``: the step the
detector fired or None, ``p_max``) and ``extra.oracle`` (``success``: the simulator's verdict, read by the audit and
the evaluation only, never by a learner).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleet.labels_config import LabelsConfig

log = logging.getLogger(__name__)

SOURCES = ("human", "detector", "sim")


@dataclass
class Acting:
    """How a plan's trials are labelled and continued (picklable: it crosses to the fleet's spawned processes).

    Args:
        source: ``"human"`` | ``"detector"`` | ``"sim"`` (see the module docstring).
        labels: ``labels`` config (a :class:`fleet.labels_config.LabelsConfig` mapping).
        detector_dir: the fitted detector (``source="detector"``).
        record_dir: where a labelled episode's detector frames go (``<episode_id>.npz``; ``source="human"``).
        recovery: a ``fert.retry`` mapping with ``start: recovery`` to follow each failure with recovery attempts
            from its final state; None: none.

    Raises:
        ValueError: an unknown source, or ``detector`` without a ``detector_dir``.
    """

    source: str
    labels: dict
    detector_dir: str | None = None
    record_dir: str | None = None
    recovery: dict | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"Acting.source: expected one of {SOURCES}, given {self.source!r}")
        if self.source == "detector" and not self.detector_dir:
            raise ValueError("Acting: source 'detector' needs detector_dir (the fitted success detector)")
        self.labels = LabelsConfig.from_dict(self.labels).to_dict()

    @property
    def stop_on_success(self) -> bool:
        """Whether the simulator's success may end an episode (not when the detector labels, nor in a labelled
        episode with ``labels.budget_full_length``)."""
        if self.source == "human":
            return not bool(self.labels.get("budget_full_length", False))
        return self.source != "detector"

    def task_config(self, task_cfg: dict) -> dict:
        """``task_cfg`` with ``stop_on_success`` as this labelling needs it."""
        return {**dict(task_cfg), "stop_on_success": self.stop_on_success}


class Recovery:
    """Recovery attempts after a failure, from the state where it ended (``fert.retry`` with ``start: recovery``).

    Attempt ``k`` (0-based) explores with held action noise ``action_noise_std * growth ** k`` and denoising-noise
    temperature ``noise_temperature * temperature_growth ** k`` (``fleet.worker.Exploration``), for
    ``recovery_steps`` steps; attempts stop at the first success (by the episode's label) or after ``attempts``.

    Raises:
        configs.rules.ConfigError: a bad ``fert.retry`` value.
    """

    def __init__(self, retry: dict) -> None:
        from fleet.fert.config import RetryConfig

        c = RetryConfig.from_dict(retry)
        self.attempts, self.steps = int(c.attempts), int(c.recovery_steps)
        self._c = c

    def exploration(self, attempt: int):
        """The ``fleet.worker.Exploration`` of attempt ``attempt`` (``retry_of`` set when it is committed)."""
        from fleet.worker import Exploration

        c = self._c
        return Exploration(action_noise_std=c.action_noise_std * c.growth ** attempt, hold_steps=c.hold_steps,
                           attempt=attempt, noise_temperature=c.noise_temperature * c.temperature_growth ** attempt)


class OnlineLabeller:
    """The detector's side of one process's vectorised fleet: frames of the unit's cameras, the detector's verdicts
    and the labelled budget's frame records.

    Args:
        acting: :class:`Acting` (``source`` ``human``: record frames every ``labels.record_every`` steps;
            ``detector``: judge every ``labels.every`` steps).
    """

    def __init__(self, acting: Acting) -> None:
        from sim.gl import FrameGrabber

        self.acting = acting
        lc = LabelsConfig.from_dict(acting.labels)
        self.cameras, self.every = list(lc.cameras), int(lc.every)
        self.record_every = int(lc.record_every)
        self.grabber = FrameGrabber(lc.image_size, lc.image_size)
        self.image_size = int(lc.image_size)
        self.clouds = None
        if lc.point_cloud:
            from sim.pointcloud import CloudGrabber

            self.clouds = CloudGrabber(lc.point_cameras, (lc.point_image_size, lc.point_image_size), lc.num_points,
                                       lc.crop_max, color=lc.point_color)
        self.detector = None
        if acting.source == "detector":
            from policies.success_detector import SuccessDetector

            self.detector = SuccessDetector.load(acting.detector_dir)
            sp = self.detector.spec
            want_points = int(lc.num_points) if lc.point_cloud else 0
            want_color = bool(lc.point_cloud and lc.point_color)
            if list(sp.cameras) != self.cameras or sp.image_size != lc.image_size or sp.num_points != want_points \
                    or bool(sp.point_color) != want_color or (sp.history, sp.history_every) != (
                        int(lc.history), int(lc.history_every) if lc.history else sp.history_every):
                raise ValueError(f"success detector {acting.detector_dir}: trained on cameras {sp.cameras} at "
                                 f"{sp.image_size} px, {sp.num_points} cloud points (colour: {sp.point_color}) and a "
                                 f"history of {sp.history} every {sp.history_every} steps; configured labels.cameras "
                                 f"{self.cameras} at {lc.image_size} px, {want_points} points (colour: {want_color}) "
                                 f"and labels.history {lc.history} every {lc.history_every}")

    @property
    def detects(self) -> bool:
        return self.detector is not None

    def due(self, seg_t: int) -> bool:
        """Whether a segment at step ``seg_t`` (>= 1) is judged (detector) or recorded (labelled budget) now."""
        if self.detector is not None:
            return seg_t % self.every == 0
        return self.acting.source == "human" and seg_t % self.record_every == 0

    def frames(self, env) -> np.ndarray:
        """(C, H, W, 3) uint8: the detector's cameras of ``env`` now (C = 0 without cameras)."""
        if not self.cameras:
            return np.zeros((0, self.image_size, self.image_size, 3), np.uint8)
        return self.grabber.frames(env, self.cameras)

    def cloud(self, env) -> np.ndarray | None:
        """(N, 3) float32 ((N, 6) with ``labels.point_color``: RGB after the coordinates): the detector's point cloud
        of ``env`` now (``labels.point_cloud``), else None."""
        return None if self.clouds is None else self.clouds.cloud(env)

    def judge(self, frames: np.ndarray, states: np.ndarray, tasks: list[str],
              clouds: np.ndarray | None = None, history: np.ndarray | None = None) -> np.ndarray:
        """(B,) success probabilities of frames (B, C, H, W, 3) uint8 with proprioception (B, S) float32 and, for a
        detector that reads them, clouds (B, N, 3) float32 and the proprioception history (B, H, S) float32
        (:meth:`history_steps`)."""
        import torch

        idx = torch.tensor([self.detector.task_index(t) for t in tasks])
        return self.detector.probability(torch.as_tensor(frames), torch.as_tensor(states, dtype=torch.float32),
                                         idx, None if clouds is None else torch.as_tensor(clouds),
                                         None if history is None else torch.as_tensor(history)).numpy()

    def history_steps(self, t: int) -> list[int]:
        """The steps of the detector's proprioception history at judged step ``t`` (empty without one), clamped to
        the labelled budget's first recorded step as in training (``policies.success_detector.history_steps``)."""
        from policies.success_detector import history_steps

        sp = self.detector.spec
        return history_steps(t, sp.history, sp.history_every, self.record_every) if sp.history else []

    def threshold_of(self, task: str) -> float:
        """The detector's firing threshold for ``task`` (per task when fitted so)."""
        return self.detector.spec.threshold_of(task)

    def close(self) -> None:
        self.grabber.close()
        if self.clouds is not None:
            self.clouds.close()


def trusted_label(meta, margin: float) -> bool:
    """Whether a learner reads episode ``meta`` (an ``EpisodeMeta``) under ``labels.trust_margin`` ``margin``.

    An episode the detector labelled is trusted when its largest success probability ``p_max`` is at least
    ``margin`` from the threshold it was judged against, on the side of its verdict: a success with ``p_max >=
    threshold + margin``, a failure with ``p_max <= threshold - margin``. Demonstrations, the person's labels
    (``source: human``), the simulator's and every episode when ``margin <= 0`` are trusted.

    Raises:
        ValueError: a detector label without the ``threshold`` it was judged against (an episode written before
            labels carried it) while ``margin > 0``.
    """
    lab = (meta.extra or {}).get("label") if margin > 0 and not meta.is_demo else None
    if not lab or lab.get("source") != "detector":
        return True
    if lab.get("threshold") is None:
        raise ValueError(f"episode {meta.episode_id}: its detector label names no threshold, so labels.trust_margin "
                         f"{margin} cannot be applied (a store written before labels carried it); set it to 0")
    p, thr = float(lab["p_max"]), float(lab["threshold"])
    return p >= thr + margin if meta.success else p <= thr - margin


class TrustedLabels:
    """A store reader (``ExperienceStore``) whose :meth:`episodes` leaves out the episodes a learner should not read
    under ``labels.trust_margin`` (:func:`trusted_label`): detector labels too close to the firing threshold count
    neither as successes nor as failures. Every other attribute is the reader's.

    Why: the detector's precision rises with its confidence (experiment 59's store: positives with ``p_max`` in
    [0.7, 0.8) were 75 % true, above 0.99 all true), and imitation learns from its positives.
    """

    def __init__(self, reader, margin: float) -> None:
        self._reader, self.margin = reader, float(margin)

    def episodes(self, *args, **kwargs) -> list:
        return [m for m in self._reader.episodes(*args, **kwargs) if trusted_label(m, self.margin)]

    def __getattr__(self, name: str):
        return getattr(self._reader, name)

    def __len__(self) -> int:
        return len(self.episodes())


def learner_reader(url: str, labels: dict | None):
    """The store at ``url`` as a learner reads it: an ``ExperienceStore``, wrapped in :class:`TrustedLabels` when
    ``labels.trust_margin`` (``labels``: the ``labels`` config mapping; None: the defaults) is above 0."""
    from experience_dict.store import ExperienceStore

    reader = ExperienceStore.open(url)
    margin = float(LabelsConfig.from_dict(labels).trust_margin)
    return TrustedLabels(reader, margin) if margin > 0 else reader


def save_record(record_dir: str | Path, episode_id: str, task: str, frames: list, states: list, steps: list,
                success: bool, first_success: int | None, done_now: list | None = None,
                clouds: list | None = None, cameras: list[str] | None = None) -> Path:
    """Write one labelled episode's detector frames: ``<record_dir>/<episode_id>.npz`` with ``frames`` (K, C, H, W,
    3) uint8, ``state`` (K, S) float32, ``step`` (K,) int64 (the episode step after which each frame was taken),
    and the person's labels: ``success``, ``first_success`` (the step of the success moment, -1 for none) and,
    when given, ``done_now`` (K,) bool: whether the task is done in each frame (the person's per-frame mark; the
    simulator's success at that step stands in for it) and, with ``labels.point_cloud``, ``clouds`` (K, N, 3)
    float32 metres ((K, N, 6) with ``labels.point_color``: RGB 0..255 after the coordinates); ``cameras``: the
    names of the frames' C cameras, in order (so a detector reading fewer cameras picks its own,
    :func:`record_inputs`)."""
    d = Path(record_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{episode_id}.npz"
    np.savez_compressed(path, frames=np.asarray(frames, np.uint8), state=np.asarray(states, np.float32),
                        step=np.asarray(steps, np.int64), task=np.array(str(task)), success=np.array(bool(success)),
                        first_success=np.array(-1 if first_success is None else int(first_success)),
                        **({} if done_now is None else {"done_now": np.asarray(done_now, bool)}),
                        **({} if not clouds else {"clouds": np.asarray(clouds, np.float32)}),
                        **({} if cameras is None else {"cameras": np.asarray([str(c) for c in cameras])}))
    return path


def record_inputs(rec: dict, spec) -> dict:
    """The record ``rec`` with only what a detector of ``spec`` (``policies.success_detector.DetectorSpec``) reads:
    its cameras' frames (K, len(spec.cameras), H, W, 3) in the spec's order, and its clouds (K, N, 3 or 6) without
    colour when the spec has none. A budget recorded with more cameras or with colour can so be fitted to a
    detector that reads fewer.

    Raises:
        ValueError: a camera the spec reads is not in the record (or the record names no cameras and holds a
            different number of them), the frames' size differs from the spec's, the spec reads colour the record
            lacks, or a different number of points.
    """
    frames = np.asarray(rec["frames"])
    have = [str(c) for c in rec["cameras"]] if "cameras" in rec else None
    want = list(spec.cameras)
    if not want:
        frames = frames[:, :0]
    elif have is not None:
        missing = [c for c in want if c not in have]
        if missing:
            raise ValueError(f"success detector: record {rec.get('episode_id')} holds cameras {have}, not {missing} "
                             f"that the detector reads (labels.cameras={want}); record the budget with them")
        frames = frames[:, [have.index(c) for c in want]]
    elif frames.shape[1] != len(want):
        raise ValueError(f"success detector: record {rec.get('episode_id')} holds {frames.shape[1]} unnamed cameras, "
                         f"the detector reads {len(want)} ({want}); record the budget again with labels.cameras={want}")
    if want and tuple(frames.shape[2:4]) != (spec.image_size, spec.image_size):
        raise ValueError(f"success detector: record {rec.get('episode_id')} holds {frames.shape[2]}x{frames.shape[3]} "
                         f"frames, the detector reads {spec.image_size} px (labels.image_size)")
    out = {**rec, "frames": frames, "cameras": np.asarray(want, dtype=str)}
    if spec.num_points:
        clouds = record_clouds(rec)
        ch = 6 if spec.point_color else 3
        if clouds.shape[-1] < ch:
            raise ValueError(f"labels.point_color: record {rec.get('episode_id')} holds clouds without colour "
                             "(record the budget again with labels.point_color=true)")
        if clouds.shape[1] != spec.num_points:
            raise ValueError(f"labels.num_points: record {rec.get('episode_id')} holds clouds of {clouds.shape[1]} "
                             f"points, the detector reads {spec.num_points}")
        out["clouds"] = clouds[..., :ch]
    return out


def load_records(record_dir: str | Path) -> list[dict]:
    """Every labelled episode's record in ``record_dir`` (sorted by episode id): dicts of :func:`save_record`'s
    arrays plus ``episode_id``.

    Raises:
        FileNotFoundError: no records there.
    """
    files = sorted(Path(record_dir).glob("*.npz"))
    if not files:
        raise FileNotFoundError(f"no labelled detector records in {record_dir}")
    out = []
    for f in files:
        with np.load(f, allow_pickle=False) as z:
            out.append({"episode_id": f.stem, **{k: z[k] for k in z.files}})
    return out


def frame_labels(rec: dict, mode: str = "ever") -> np.ndarray:
    """(K,) int64 frame labels of one record. ``mode`` ``"ever"``: 1 for a frame at or after the person's success
    moment of a successful episode, else 0; ``"now"``: 1 where the task is done in that frame (``done_now``).

    Raises:
        ValueError: ``"now"`` for a record without ``done_now`` (recorded before it was kept), or an unknown mode.
    """
    if mode == "now":
        if "done_now" not in rec:
            raise ValueError(f"labels.frame_label=now: record {rec.get('episode_id')} has no per-frame marks "
                             "(done_now); record the budget again or use frame_label=ever")
        return np.asarray(rec["done_now"], np.int64)
    if mode != "ever":
        raise ValueError(f"labels.frame_label: expected 'ever' or 'now', given {mode!r}")
    if not bool(rec["success"]):
        return np.zeros(len(rec["step"]), np.int64)
    return (rec["step"] >= int(rec["first_success"])).astype(np.int64)


def _episode_verdicts(model, recs: list[dict], every: int) -> np.ndarray:
    """(E,) the largest success probability over each record's frames at the fleet's judging steps."""
    import torch

    out = []
    sp = model.spec
    for r in recs:
        r = record_inputs(r, sp)
        keep = (r["step"] % every == 0)
        if not keep.any():
            keep[:] = True
        t = torch.full((int(keep.sum()),), model.task_index(str(r["task"])))
        clouds = torch.as_tensor(r["clouds"][keep]) if sp.num_points else None
        hist = torch.as_tensor(record_history(r, sp.history, sp.history_every)[keep]) if sp.history else None
        out.append(float(model.probability(torch.as_tensor(r["frames"][keep]), torch.as_tensor(r["state"][keep]),
                                           t, clouds, hist).max()))
    return np.asarray(out)


def record_history(rec: dict, history: int, every: int) -> np.ndarray:
    """(K, H, S) float32: for each frame of a record, its proprioception ``history`` samples back, ``every`` steps
    apart (``policies.success_detector.history_steps``, clamped to the record's first step).

    Raises:
        ValueError: a history step the record does not hold (``every`` not a multiple of its recording interval).
    """
    from policies.success_detector import history_steps

    steps, state = np.asarray(rec["step"]), np.asarray(rec["state"], np.float32)
    row = {int(t): i for i, t in enumerate(steps)}
    out = np.empty((len(steps), int(history), state.shape[-1]), np.float32)
    for i, t in enumerate(steps):
        for k, s in enumerate(history_steps(int(t), history, every, int(steps[0]))):
            if s not in row:
                raise ValueError(f"labels.history_every={every}: record {rec.get('episode_id')} holds no frame at "
                                 f"step {s} (it was recorded every {int(steps[1] - steps[0]) if len(steps) > 1 else '?'}"
                                 " steps)")
            out[i, k] = state[row[s]]
    return out


def choose_thresholds(p_max: np.ndarray, truth: np.ndarray, tasks_of: list[str] | None = None) -> dict:
    """The firing threshold(s) with the largest balanced accuracy over 0.05..0.95 (ties: nearest 0.5) on held-out
    episodes' largest probabilities ``p_max`` (E,) against ``truth`` (E,) bool; with ``tasks_of`` (E task names),
    one per task (a task whose episodes hold one class only keeps the overall threshold).

    Returns:
        ``{"threshold": float, "tasks": {task: float}}`` (``tasks`` empty without ``tasks_of``).
    """
    grid = np.round(np.arange(0.05, 0.96, 0.05), 2)
    p_max, truth = np.asarray(p_max, float), np.asarray(truth, bool)

    def best(sel) -> float:
        def balanced(tau: float) -> float:
            s = binary_scores(p_max[sel] > tau, truth[sel])
            return 0.5 * (s["tp"] / max(s["tp"] + s["fn"], 1) + s["tn"] / max(s["tn"] + s["fp"], 1))
        return float(max(grid, key=lambda x: (balanced(x), -abs(x - 0.5))))

    everything = np.ones(len(truth), bool)
    tau = best(everything)
    per = {}
    for t in sorted(set(tasks_of or [])):
        sel = np.array([x == t for x in tasks_of])
        per[t] = best(sel) if 0 < truth[sel].sum() < sel.sum() else tau
    return {"threshold": tau, "tasks": per}


def record_clouds(rec: dict) -> np.ndarray:
    """(K, N, 3) float32 ((K, N, 6) when recorded with colour): a record's point clouds.

    Raises:
        ValueError: the record holds none (recorded without ``labels.point_cloud``)."""
    if "clouds" not in rec:
        raise ValueError(f"labels.point_cloud: record {rec.get('episode_id')} holds no point clouds (record the "
                         "budget again with labels.point_cloud=true)")
    return np.asarray(rec["clouds"], np.float32)


def _stack(recs: list[dict], tasks: list[str], mode: str = "ever", clouds: bool = False,
           history: tuple[int, int] = (0, 2)):
    """``(frames, state, task, label, clouds or None, history or None)`` tensors of every frame of ``recs``
    (``history``: ``(samples, every)``, :func:`record_history`)."""
    import torch

    frames = torch.as_tensor(np.concatenate([r["frames"] for r in recs]))
    state = torch.as_tensor(np.concatenate([r["state"] for r in recs]))
    task = torch.as_tensor(np.concatenate([np.full(len(r["step"]), tasks.index(str(r["task"]))) for r in recs]))
    label = torch.as_tensor(np.concatenate([frame_labels(r, mode) for r in recs]))
    cl = torch.as_tensor(np.concatenate([record_clouds(r) for r in recs])) if clouds else None
    hist = torch.as_tensor(np.concatenate([record_history(r, *history) for r in recs])) if history[0] else None
    return frames, state, task, label, cl, hist


def binary_scores(pred, truth) -> dict[str, Any]:
    """``{"n", "tp", "fp", "fn", "tn", "precision", "recall", "accuracy"}`` of boolean predictions against truths
    (precision / recall None when undefined)."""
    p, t = np.asarray(pred, bool), np.asarray(truth, bool)
    tp, fp = int((p & t).sum()), int((p & ~t).sum())
    fn, tn = int((~p & t).sum()), int((~p & ~t).sum())
    return {"n": len(p), "tp": tp, "fp": fp, "fn": fn, "tn": tn,
            "precision": tp / (tp + fp) if tp + fp else None, "recall": tp / (tp + fn) if tp + fn else None,
            "accuracy": (tp + tn) / len(p) if len(p) else None}


def fit_from_records(record_dir: str | Path, labels: dict, tasks: list[str], out_dir: str | Path,
                     seed: int = 0) -> dict[str, Any]:
    """Fit the success detector on the labelled budget's records and save it to ``out_dir``.

    The labelled episodes are split (seeded) into a fit part and ``labels.val_share`` held out. The detector is fitted
    on the fit part; it judges the held-out episodes as the fleet would (largest probability over the frames at the
    judging steps) and the threshold with the largest balanced accuracy is chosen (ties: nearest 0.5), unless
    ``labels.threshold`` fixes it; it is saved with that threshold. (A refit on every labelled episode would cost
    a second fit, ~1.5 min on one CPU thread.)

    Returns:
        ``{"episodes", "frames", "positives", "threshold", "validation": binary_scores of the held-out episodes,
        "fit_s"}``.

    Raises:
        FileNotFoundError: no records. ValueError: the labelled budget lacks successes or failures.
    """
    import time

    from policies.success_detector import DetectorSpec, fit_detector

    lc = LabelsConfig.from_dict(labels)
    t0 = time.perf_counter()
    recs = load_records(record_dir)
    truth = np.array([bool(r["success"]) for r in recs])
    if truth.all() or not truth.any():
        raise ValueError(f"success detector: the {len(recs)} labelled episodes in {record_dir} are all "
                         f"{'successes' if truth.all() else 'failures'}; the budget must hold both")
    rng = np.random.default_rng(int(seed))
    order = rng.permutation(len(recs))
    n_val = max(1, round(lc.val_share * len(recs)))
    val, fit = [recs[i] for i in order[:n_val]], [recs[i] for i in order[n_val:]]

    def spec() -> DetectorSpec:
        S = int(recs[0]["state"].shape[-1])
        return DetectorSpec(tasks=list(tasks), cameras=list(lc.cameras), image_size=lc.image_size, state_dim=S,
                            width=lc.width, num_points=int(lc.num_points) if lc.point_cloud else 0,
                            point_color=bool(lc.point_cloud and lc.point_color), history=int(lc.history),
                            history_every=int(lc.history_every))

    kw = {"updates": lc.updates, "batch_size": lc.batch_size, "lr": lc.lr, "seed": int(seed)}
    sp = spec()
    fit, val = [record_inputs(r, sp) for r in fit], [record_inputs(r, sp) for r in val]
    *data, clouds, hist = _stack(fit, list(tasks), lc.frame_label, clouds=bool(lc.point_cloud),
                                 history=(int(lc.history), int(lc.history_every)))
    model, info = fit_detector(sp, *data, clouds=clouds, history=hist, **kw)
    p_val = _episode_verdicts(model, val, lc.every)
    t_val = np.array([bool(r["success"]) for r in val])
    val_tasks = [str(r["task"]) for r in val]
    if lc.threshold is not None:
        tau, per = float(lc.threshold), {}
    else:
        chosen = choose_thresholds(p_val, t_val, val_tasks if lc.per_task_threshold else None)
        tau, per = chosen["threshold"], chosen["tasks"]
    model.spec.threshold = tau
    model.spec.task_thresholds = [float(per.get(t, tau)) for t in model.spec.tasks] if per else []
    val_scores = binary_scores(p_val > np.array([model.spec.threshold_of(t) for t in val_tasks]), t_val)
    model.save(out_dir)
    out = {"episodes": len(recs), "fit_episodes": len(fit), "successes": int(truth.sum()), "frames": info["frames"],
           "positives": info["positives"], "threshold": tau, "task_thresholds": per, "validation": val_scores,
           "fit_s": time.perf_counter() - t0}
    (Path(out_dir) / "fit.json").write_text(json.dumps(out, indent=1))
    return out


def label_audit(episodes) -> dict[str, Any]:
    """The detector's labels against the simulator's on committed episodes (``EpisodeMeta``: those whose
    ``extra.label.source`` is ``detector``) or run summaries (``label_source`` / ``oracle_success``); overall and per
    task.

    Returns:
        ``{"overall": binary_scores, "tasks": {task: binary_scores}}`` (``overall`` with ``n`` 0 when none).
    """
    rows: dict[str, list] = {}
    for m in episodes:
        if isinstance(m, dict):   # a run summary (fleet.experiment.evaluation.run_plan_vectorised)
            if m.get("label_source") != "detector":
                continue
            rows.setdefault(str(m["task"]), []).append((bool(m["success"]), bool(m["oracle_success"])))
            continue
        lab, orc = (m.extra or {}).get("label") or {}, (m.extra or {}).get("oracle") or {}
        if lab.get("source") != "detector" or "success" not in orc:
            continue
        rows.setdefault(str(m.task), []).append((bool(m.success), bool(orc["success"])))
    every = [r for v in rows.values() for r in v]
    overall = binary_scores([p for p, _ in every], [t for _, t in every])
    return {"overall": overall, "tasks": {t: binary_scores([p for p, _ in v], [q for _, q in v])
                                         for t, v in sorted(rows.items())}}

