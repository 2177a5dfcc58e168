"""Where the fleet's success labels come from: Hydra's config group ``labels`` (typed, registered by ``configs.typed``).

``labels.source: sim`` (the default) labels every fleet episode with the simulator's success and lets that success
end the episode. ``labels.source: detector`` is what a real fleet has instead (``experiment=deployed``): the first
``budget_episodes`` episodes of the first round are labelled by a person (the simulator's verdict and success
moment stand in for theirs, counted as labelling effort), a success detector that sees only the robot's cameras and
proprioception is fitted on them (``policies.success_detector``), and from then on it alone labels the fleet's
episodes and ends them when it fires. The simulator's verdict is kept beside each label (``extra.oracle``) for the
audit only. No torch, zarr, MuJoCo or Ray is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from configs.rules import POS, POS_NUMBER, TypedConfig, boolean, integer, names, number, one_of, optional, xyz


@dataclass
class LabelsConfig(TypedConfig):
    """The fleet's success labels and, with ``source: detector``, the learned success detector (``fleet.labels``).

    Raises:
        configs.rules.ConfigError: (a ``ValueError``) every value out of range, ``labels.<key>: expected ..., given
            ...``, or an unknown key.
    """

    source: str = "sim"
    """sim: the simulator's success labels and ends fleet episodes | detector: the learned success detector does,
    after a labelled budget."""
    budget_episodes: int = 120
    """Episodes of the first fleet round labelled by a person (the first of its fixed plan), the detector's
    training set: the labelling effort a deployment pays once."""
    cameras: list[str] = field(default_factory=lambda: ["corner", "topview"])
    """The cameras the detector sees (the robot's, whatever the policy sees); [] with ``point_cloud``: none."""
    point_cloud: bool = False
    """The detector also sees the depth cameras' workspace point cloud (``sim.pointcloud.CloudGrabber``: metric
    geometry, e.g. how far a window has slid or the hand is from a marker)."""
    point_cameras: list[str] = field(default_factory=lambda: ["corner", "corner3"])
    """Depth cameras of the detector's point cloud."""
    point_image_size: int = 64
    """Depth image size of the detector's point cloud, pixels."""
    num_points: int = 256
    """Points of the detector's cloud (farthest-point sampled)."""
    point_color: bool = False
    """Each point of the detector's cloud also carries its colour (the depth cameras' aligned colour images; the
    reach goal is the scene's one red object)."""
    crop_max: list[float] | None = None
    """The detector cloud's workspace box, upper corner (base frame, metres); null: the embodiment's."""
    image_size: int = 64
    """Detector frames are image_size x image_size pixels."""
    every: int = 5
    """The detector judges the current frame every this many control steps of a fleet episode."""
    record_every: int = 2
    """In a labelled episode, a frame is recorded for the detector's training every this many steps."""
    budget_full_length: bool = False
    """Labelled-budget episodes run their whole time budget after the person's success mark (the simulator's success
    does not end them): about 15x the detector's positive frames, and frames of what a robot does after success."""
    frame_label: str = "ever"
    """What the detector learns per frame: ever | now. ever: done from the person's success moment to the end of a
    successful episode; now: done in this frame (the person's per-frame mark). A task whose success is a moment
    (reach passes through its goal and moves on) is mislabelled by ever in the frames after it."""
    history: int = 0
    """The detector also reads the robot's proprioception at this many earlier instants, ``history_every`` steps
    apart, as offsets from now (``policies.success_detector.history_steps``); 0: the current frame only."""
    history_every: int = 2
    """Steps between the history's samples (a multiple of ``record_every``, so the labelled budget holds them)."""
    per_task_threshold: bool = False
    """Choose the firing threshold per task on the held-out labelled episodes (else one for every task)."""
    val_share: float = 0.25
    """Share of the labelled episodes held out to choose the detector's threshold (episode-level, online rule)."""
    threshold: float | None = None
    """Fixed firing threshold; null: chosen on the held-out labelled episodes (the largest balanced accuracy)."""
    updates: int = 800
    """AdamW updates of the detector's fit (~0.1 s each on one CPU thread)."""
    batch_size: int = 64
    """Frames per update."""
    lr: float = 1.0e-3
    """AdamW learning rate (cosine to 0)."""
    width: int = 16
    """Channels of the detector's first convolution."""
    trust_margin: float = 0.0
    """Learners read a detector-labelled fleet episode only when its largest success probability is at least this far
    from the firing threshold on the side of its verdict (``fleet.labels.trusted_label``); the others are left out of
    every learner's data (the critic, the filtered successes, FERT's failures and retrieval pool, filtered BC). 0: every
    label is read. The fleet, the gate and the audit are unchanged."""
    audit_trials_per_task: int = 50
    """Held-out audit: trials per task of the base and the final version on held-out units with the detector
    acting as on the fleet, its labels against the simulator's (precision, recall); 0: no audit."""

    def problems(self, prefix: str | None = None) -> list[str]:
        """The field rules, and: the detector sees something (a camera or the point cloud); its history's spacing is
        one the labelled budget records."""
        bad = super().problems(prefix)
        if self.history and isinstance(self.record_every, int) and self.record_every > 0 \
                and isinstance(self.history_every, int) and self.history_every % self.record_every:
            bad.append(f"{prefix or self._group}.history_every: expected a multiple of record_every "
                       f"({self.record_every}) so the labelled budget holds the history, given {self.history_every}")
        if not self.cameras and not self.point_cloud:
            bad.append(f"{prefix or self._group}.cameras: expected at least one camera unless point_cloud is true, "
                       "given []")
        return bad


def _cameras(v) -> str | None:
    return None if isinstance(v, list | tuple) and all(isinstance(x, str) and x for x in v) \
        else "a list of camera names"


LabelsConfig._group, LabelsConfig._rules = "labels", {
    "source": one_of("sim", "detector"), "budget_episodes": POS, "cameras": _cameras, "image_size": integer(16),
    "point_cloud": boolean, "point_cameras": names, "point_image_size": integer(8), "num_points": POS,
    "point_color": boolean, "crop_max": xyz,
    "every": POS, "record_every": POS, "budget_full_length": boolean, "frame_label": one_of("ever", "now"),
    "history": integer(0), "history_every": POS, "per_task_threshold": boolean,
    "val_share": number(0.05, 0.5), "trust_margin": number(0, 1), "threshold": optional(number(0, 1, True)),
    "updates": POS, "batch_size": POS, "lr": POS_NUMBER, "width": POS, "audit_trials_per_task": integer(0)}
