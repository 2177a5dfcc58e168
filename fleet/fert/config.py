"""FERT's typed config: Hydra's config group ``fert``, and the one place its defaults live.

:class:`FertConfig` is registered in Hydra's ConfigStore as ``fert/default`` (:mod:`configs.typed`), so an
unknown key (``fert.top_kk=4``) or a wrong type (``fert.window=long``) is refused while the config is composed,
naming the key, and a value out of range by ``configs.schema.check`` before any work. Every part of FERT reads
its part of the group through ``from_dict`` of its dataclass, so a key a caller leaves out takes the value below:
failure contexts and retrieval (``fleet.fert.data.FertData``), the failure retries
(:class:`RetryConfig`, ``fleet.experiment.protocol.run_retries``), the success critic (:class:`CriticConfig`,
``fleet.fert.critic_fit.fit_critic``), the critic's distillation and the round's mix (``fleet.fert.learner``). Presets
(``configs/experiment/*.yaml``) override fields of it. No heavy imports (numpy): ``policies`` and ``fleet`` import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from configs.rules import POS, TypedConfig, boolean, integer, number, one_of, optional
from fleet.fert.failure import DEFAULT_SIGNALS


@dataclass
class GateConfig(TypedConfig):
    """The progress gate and advantage weights of retrieved segments (``fleet.fert.failure.
    progress_advantage``; AWR's exponentiated advantage, Peng et al. 2019)."""

    enabled: bool = True
    """Gate and weight the retrieved segments (off: every neighbour with its similarity weight alone)."""
    min_gain: float = 0.02
    """A segment must gain this much more progress (score in [0, 1]) than the failure did after its onset."""
    beta: float = 0.05
    """Advantage temperature: weight exp(A / beta), clipped at ``max_weight``."""
    max_weight: float = 20.0
    """Clip of the advantage weight."""
    tail_steps: int | None = None
    """Anchors in the last n steps (after the first success) are not indexed (null: ``task.steps_after_success``,
    filled in by the learner)."""
    horizon: int | None = None
    """Segment length for the gains, steps (null: ``segment_steps``)."""


@dataclass
class RetryConfig(TypedConfig):
    """Failure-guided exploration (``fleet.experiment.protocol.run_retries``): each failed fleet trial re-attempted on the
    same unit and reset seed with held end-effector action noise, growing every attempt, until a success."""

    enabled: bool = True
    """Retry the round's failures."""
    attempts: int = 6
    """Re-attempts per failure at most (stops at the first success)."""
    action_noise_std: float = 0.2
    """Std of the held end-effector action noise on the first attempt (action units)."""
    growth: float = 1.3
    """Noise std multiplied by this with every further attempt (0.2 .. 0.74 over 6)."""
    hold_steps: int = 8
    """The noise is redrawn every hold_steps control steps and held in between."""
    max_share: float = 1.5
    """Retry episodes at most this share of the round's fleet episodes."""
    noise_temperature: float = 1.0
    """Scale of the policy's initial denoising noise on the first attempt (1: as trained; > 1: modal-level
    exploration, every action still the denoiser's own output)."""
    temperature_growth: float = 1.0
    """Temperature multiplied by this with every further attempt."""
    start: str = "replay"
    """replay: a retry resets the failed trial's world from its reset seed (a simulator's privilege) | recovery: it
    goes on from the state where the failure ended, at once, as a real robot can (``fleet.labels.Recovery``;
    ``experiment=deployed``)."""
    recovery_steps: int = 150
    """With ``start: recovery``: control steps of each recovery attempt (Meta-World episodes chain to 500 steps
    at most per reset: 150 + 2 x 150 fits)."""


@dataclass
class CriticConfig(TypedConfig):
    """The success critic (``policies.critic``): fitted each round on the store's successes and failures, shipped
    in the checkpoint; the policy executes, of ``candidates`` chunks sampled from its own denoiser, the one the
    critic ranks highest (V-GPS, Nakamoto et al. 2024)."""

    enabled: bool = True
    """Fit a critic with every FERT round and ship it in the published checkpoint."""
    candidates: int = 8
    """K: chunks sampled per decision (the first from the trial's own noise)."""
    images: bool = True
    """With a policy that sees cameras: the critic scores them too, through a frozen copy of the policy's image
    encoder pooled to one vector per camera (``policies.critic.CriticFeatures``); false: its state vectors only."""
    members: int = 5
    """Ensemble of MLPs, each on its own bootstrap of the batch."""
    hidden: int = 256
    """Width of the 3 hidden layers."""
    dropout: float = 0.2
    """Dropout of the hidden layers."""
    updates: int = 1000
    """AdamW updates."""
    batch_size: int = 512
    """Steps per update."""
    lr: float = 1.0e-3
    """AdamW learning rate."""
    weight_decay: float = 1.0e-4
    """AdamW weight decay."""
    gamma: float = 0.99
    """Target gamma^(steps to the first success) per control step; 0 on failed episodes."""
    val_fraction: float = 0.1
    """Episodes held out for the reported validation loss (not used to pick anything)."""
    fit_process: bool = True
    """CPU: fit in a process of its own while the learner samples the distillation's candidates."""


@dataclass
class MixConfig(TypedConfig):
    """``learner.round_init: published``: shares of a round's training windows (normalised to sum 1)."""

    retrieved: float = 0.25
    """FERT's retrieved segments (the cause-keyed retrieval)."""
    distill: float = 0.5
    """The critic's chosen chunks at the fleet's states (``distill``)."""
    replay: float = 0.25
    """Per-task balanced replay: each task's demonstrations + its successful fleet episodes."""


@dataclass
class DistillConfig(TypedConfig):
    """Critic distillation (``policies.distill``; PA-RL, Mark et al. 2024): at states of every training-unit
    episode, the round's starting policy samples ``critic.candidates`` chunks and the one the new critic ranks best
    becomes the training target."""

    enabled: bool = True
    """Distil the critic's choices into the weights."""
    states_per_task: int = 1024
    """States relabelled per task per round."""
    batch_size: int = 128
    """States per batched relabelling call."""


def _default_signals() -> dict[str, Any]:
    return {k: [kind, scale] for k, (kind, scale) in DEFAULT_SIGNALS.items()}


@dataclass
class OnsetConfig(TypedConfig):
    """Failure onset (``fleet.fert.failure``): where a failed episode stopped making progress."""

    tolerance: float = 0.02
    """Progress-score rise still counted as "no improvement" (score in [0, 1])."""
    signals: dict[str, Any] = field(default_factory=_default_signals)
    """``{progress key: [kind, scale]}``; kind level (higher is better) or distance (lower is better); see
    ``fleet/fert/failure.py`` for the choice."""
    progress: bool = True
    """Read the simulator's progress signals. False (``experiment=deployed``): a deployment has none, so a
    failure's onset is its last ``window`` steps and retrieved segments are not gated on progress."""


@dataclass
class PriorityConfig(TypedConfig):
    """Task priority of the failure contexts (``fleet.fert.priority.TaskPriority``)."""

    method: str = "learnability"
    """learnability: p (1 - p) per task from recent episodes | uniform."""
    window: int = 50
    """Recent episodes per task for the success rate p."""
    floor: float = 0.02
    """Added to every task's p (1 - p)."""


@dataclass
class FertConfig(TypedConfig):
    """Failure-guided experience retrieval fine-tuning (FERT): the failure contexts, the retrieval of similar
    successful experience from the whole fleet, the retries, the critic and its distillation, and the round's data
    mix. Units: metres where a name ends in ``_m``; windows and segments in steps (frames with ``frame_stride``).

    Raises:
        configs.rules.ConfigError: (a ``ValueError``) listing every value out of its range,
            ``fert.<key>: expected ..., given ...``, nested keys included, or naming an unknown key.
    """

    rounds: int = 4
    """FERT rounds run by the main job (fleet plan + retries + learner round each); four fit ``make run``'s 25 min
    on 2 cores with margin (docs/RESULTS.md, experiment 38)."""
    window: int = 8
    """W: failure-context / embedding window, frames (steps when ``frame_stride`` = 1)."""
    key: str = "relative"
    """relative: task-relative key in metres (hand-object-goal offsets, motion), L2 | relative+aed: plus the
    policy's pooled AED action-history embedding | absolute: standardised absolute state windows, cosine (the old
    key; an ablation)."""
    aed_key_scale_m: float = 0.05
    """relative+aed: two unrelated action histories sit ~1.4 x this many metres apart."""
    include_retries: bool = True
    """Index the successful failure retries (exploration) as retrievable experience."""
    own_retries_first: bool = True
    """A failure's own successful retries rank first among its neighbours."""
    neighbours: str = "fleet"
    """fleet: own retries, then the whole fleet's successes | own_retries: only the failure's own successful retries
    (an unrecovered failure retrieves nothing)."""
    stage_match: bool = False
    """An analysis arm, not deployable (it reads the simulator's stage signals, ``fleet.stages``): a failure context
    retrieves only windows whose anchor is at the stage the failure had reached at its onset (the nearest of 16 x
    ``top_k`` candidates; a context with none retrieves nothing). It isolates whether retrieval keyed on the stage
    helps (issue 48, item 3). Tasks without stages retrieve as before."""
    gate: GateConfig = field(default_factory=GateConfig)
    """Progress gate and advantage weights."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    """Failure-guided exploration."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The success critic."""
    mix: MixConfig = field(default_factory=MixConfig)
    """The round's training mix (published mode)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """The critic's distillation."""
    frame_stride: int = 1
    """Steps between the frames of a window."""
    embed_keys: list[str] = field(default_factory=lambda: ["observation.state", "observation.environment_state"])
    """Normalised-state embedding keys (``key: absolute``, state-only runs)."""
    encoder: str = "state"
    """state: normalised state windows | policy: the policy's observation encoder features."""
    pool: str = "flatten"
    """flatten | mean | last (over the window's frames)."""
    approx_above: int | None = 100000
    """A task's index switches from exact to IVF (faiss IndexIVFFlat) at this many windows (null: always exact)."""
    nprobe: int = 32
    """IVF lists probed per query (the retrieval audit reports recall@8 against exact)."""
    tokenizer_range_warn: float = 0.05
    """Warn when more than this share of a round's new fleet action groups lie outside the AED tokenizer's fitted
    range (clipped; counted per round in the learner state and the audit)."""
    index_stride: int = 1
    """Index every n-th step of a successful episode as a window anchor."""
    include_demos: bool = True
    """Also retrieve from the (successful) bootstrap demonstrations."""
    top_k: int = 8
    """Successful windows retrieved per failure context (same task, any training unit)."""
    temperature: float = 0.1
    """Softmax temperature over the top-k similarities (similarity weights)."""
    min_similarity: float | None = None
    """Drop neighbours below this cosine similarity (null: keep all)."""
    confidence_scale_m: float | None = None
    """sigma: scale each failure context's weight by exp(-d^2 / 2 sigma^2), d its neighbours' mean key distance
    (metres for the relative key); the lost mass goes to replay (null: off)."""
    max_contexts_per_task: int = 256
    """Newest failure contexts kept per task per round."""
    replay: str = "demos"
    """What the replay part holds: demos | successes (demos + every successful training-unit fleet episode,
    retries included when ``include_retries``: filtered BC's data)."""
    replay_ratio: float = 0.25
    """Fraction of every FERT batch that replays (``learner.round_init: continue``)."""
    replay_all: bool = True
    """Tile the retrieved windows so an epoch replays every demo window once (at ``replay_ratio``)."""
    segment_steps: int = 16
    """A retrieved entry supervises its successful continuation: the windows at anchor .. anchor + 15."""
    weighting: str = "loss"
    """loss: each retrieved window once, similarity weight as sample_weight in the loss | sample: retrieved
    windows drawn in proportion to their weight, sample_weight 1."""
    onset: OnsetConfig = field(default_factory=OnsetConfig)
    """Failure onset detection."""
    priority: PriorityConfig = field(default_factory=PriorityConfig)
    """Task priority of the failure contexts."""
    audit: bool = True
    """Write ``retrieval_audit_round_<NNN>.json/.png`` with every round."""


GateConfig._group, GateConfig._rules = "fert.gate", {
    "enabled": boolean, "min_gain": number(0), "beta": number(0, open_lo=True),
    "max_weight": number(0, open_lo=True), "tail_steps": optional(integer(0)), "horizon": optional(POS)}
RetryConfig._group, RetryConfig._rules = "fert.retry", {
    "enabled": boolean, "attempts": integer(0), "action_noise_std": number(0), "growth": number(0, open_lo=True),
    "hold_steps": POS, "max_share": number(0), "noise_temperature": number(0, open_lo=True),
    "temperature_growth": number(0, open_lo=True), "start": one_of("replay", "recovery"), "recovery_steps": POS}
CriticConfig._group, CriticConfig._rules = "fert.critic", {
    "enabled": boolean, "candidates": POS, "members": POS, "hidden": POS, "dropout": number(0, 1), "updates": POS,
    "batch_size": POS, "lr": number(0, open_lo=True), "weight_decay": number(0), "gamma": number(0, 1, open_lo=True),
    "val_fraction": number(0, 1), "fit_process": boolean, "images": boolean}
MixConfig._group, MixConfig._rules = "fert.mix", {"retrieved": number(0), "distill": number(0), "replay": number(0)}
DistillConfig._group, DistillConfig._rules = "fert.distill", {"enabled": boolean, "states_per_task": POS,
                                                              "batch_size": POS}
OnsetConfig._group, OnsetConfig._rules = "fert.onset", {"tolerance": number(0), "progress": boolean}
PriorityConfig._group, PriorityConfig._rules = "fert.priority", {
    "method": one_of("learnability", "uniform"), "window": POS, "floor": number(0, 1)}
FertConfig._group, FertConfig._rules = "fert", {
    "rounds": integer(0), "window": POS, "key": one_of("relative", "relative+aed", "absolute"),
    "aed_key_scale_m": number(0, open_lo=True), "include_retries": boolean, "own_retries_first": boolean,
    "neighbours": one_of("fleet", "own_retries"), "stage_match": boolean, "frame_stride": POS, "encoder": one_of("state", "policy"),
    "pool": one_of("flatten", "mean", "last"), "approx_above": optional(integer(64)), "nprobe": POS,
    "tokenizer_range_warn": number(0, 1), "index_stride": POS, "include_demos": boolean, "top_k": POS,
    "temperature": number(0, open_lo=True), "min_similarity": optional(number(-1, 1)),
    "confidence_scale_m": optional(number(0, open_lo=True)), "max_contexts_per_task": POS,
    "replay": one_of("demos", "successes"), "replay_ratio": number(0, 1), "replay_all": boolean,
    "segment_steps": POS, "weighting": one_of("loss", "sample"), "audit": boolean}
FertConfig._nested = {"gate": GateConfig, "retry": RetryConfig, "critic": CriticConfig, "mix": MixConfig,
                      "distill": DistillConfig, "onset": OnsetConfig, "priority": PriorityConfig}
