"""Robot units: one physical robot of the fleet per integer id, with its own deterministic variation.

A unit's variation is drawn from ``numpy.random.default_rng([fleet_seed, unit_id])`` within the ranges of the
``robot`` config (:class:`configs.sim_groups.RobotConfig`); every quantity is drawn, in a fixed order, as a unit-free
uniform sample and then multiplied by its range, so a range of zero gives the nominal value and changing one
range never changes the others. ``ModelVariation`` writes a unit onto a MuJoCo model from nominal values
stored once, so applying units again and again never compounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

# Meta-World v3's cameras (the same seven in all 50 task models), in the order jitter is drawn.
EMBODIMENTS = ("sawyer", "so100")
"""Every embodiment fleetmind simulates, in the order of ``observation.embodiment``'s one-hot entries."""
CAMERAS = ("topview", "corner", "corner2", "corner3", "corner4", "behindGripper", "gripperPOV")
VARIATION_KEYS = ("camera_pos_mm", "camera_rot_deg", "light", "color", "mass_scale", "friction_scale",
                  "action_gain", "action_latency_max", "obs_noise_std")
_NOMINAL_CFG = {"embodiment": "sawyer", "fleet_seed": 0, "train_units": [], "heldout_units": [],
                "variation": {k: 0 for k in VARIATION_KEYS}}


def as_dict(cfg: Any) -> dict:
    """A plain dict from a Hydra/OmegaConf config, a Mapping or None (-> {})."""
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(cfg, Mapping):
        raise TypeError(f"config must be a mapping (dict or DictConfig), given {type(cfg).__name__}")
    return dict(cfg)


def parse_units(spec: Any, key: str = "units") -> list[int]:
    """Unit ids from a list of ints or a ``"start:stop"`` string (Python range, e.g. ``"0:96"``).

    Raises:
        ValueError: not a list of non-negative ints / malformed range, or a duplicate id.
    """
    if isinstance(spec, str):
        try:
            start, stop = (int(s) for s in spec.split(":"))
        except ValueError:
            raise ValueError(f"robot.{key}: expected a list of ints or 'start:stop', given {spec!r}") from None
        ids = list(range(start, stop))
    else:
        ids = list(spec or [])
    for u in ids:
        if isinstance(u, bool) or not isinstance(u, (int, np.integer)) or u < 0:
            raise ValueError(f"robot.{key}: unit ids must be non-negative ints, given {u!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"robot.{key}: duplicate unit ids in {ids}")
    return [int(u) for u in ids]


def unit_lists(robot_cfg: Any) -> tuple[list[int], list[int]]:
    """``(train_units, heldout_units)`` from the robot config, validated.

    Raises:
        ValueError: malformed lists, or a unit in both (held-out robots must never be trained on).
    """
    cfg = as_dict(robot_cfg)
    train = parse_units(cfg.get("train_units", []), "train_units")
    heldout = parse_units(cfg.get("heldout_units", []), "heldout_units")
    both = sorted(set(train) & set(heldout))
    if both:
        raise ValueError(f"robot config: units {both} are in both train_units and heldout_units; "
                         "held-out units must be disjoint from training units")
    return train, heldout


def demo_unit_list(robot_cfg: Any) -> list[int]:
    """The units the scripted demonstrations run on: ``robot.demo_units`` (a list or a ``"start:stop"`` range),
    else the training units.

    Raises:
        ValueError: malformed unit lists (see :func:`unit_lists`).
    """
    cfg = as_dict(robot_cfg)
    train, _ = unit_lists(cfg)
    demo = cfg.get("demo_units")
    return parse_units(demo, "demo_units") if demo else train


def check_unit(unit_id: int, robot_cfg: Any) -> None:
    """Raise ValueError unless ``unit_id`` is one of the robot config's training or held-out units (no check
    without a config)."""
    if robot_cfg is None:
        return
    train, heldout = unit_lists(robot_cfg)
    if unit_id not in train + heldout:
        raise ValueError(f"unknown unit id {unit_id!r}; the robot config names train_units {train} "
                         f"and heldout_units {heldout}")


def _variation_ranges(robot_cfg: Any) -> dict[str, float]:
    var = as_dict(robot_cfg).get("variation", {}) or {}
    unknown = sorted(set(var) - set(VARIATION_KEYS))
    if unknown:
        raise ValueError(f"robot.variation: unknown keys {unknown}; expected a subset of {list(VARIATION_KEYS)}")
    out = {k: float(var.get(k, 0.0)) for k in VARIATION_KEYS}
    for k, v in out.items():
        if not np.isfinite(v) or v < 0:
            raise ValueError(f"robot.variation.{k}: expected a finite value >= 0, given {v}")
    for k in ("mass_scale", "friction_scale", "action_gain", "light"):
        if out[k] >= 1:
            raise ValueError(f"robot.variation.{k}: expected < 1 (a factor 1 +- x must stay positive), given {out[k]}")
    if out["action_latency_max"] != int(out["action_latency_max"]):
        raise ValueError(f"robot.variation.action_latency_max: expected an integer, given {out['action_latency_max']}")
    return out


def _stratify_block(cfg: Mapping[str, Any]) -> int:
    """``robot.stratify_block`` as an int (absent/None/0/1: no stratification).

    Raises:
        ValueError: not a non-negative integer.
    """
    b = cfg.get("stratify_block")
    if b is None:
        return 0
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0:
        raise ValueError(f"robot.stratify_block: expected an integer >= 0 (0: independent draws), given {b!r}")
    return int(b)


def _stratified(x: float, unit_id: int, block: int, fleet_seed: int, dim: int) -> float:
    """A unit-free sample in [-1, 1) stratified over blocks of ``block`` consecutive unit ids.

    Ids ``b*block .. b*block + block - 1`` share one random permutation ``perm`` of the ``block`` equal strata of
    [-1, 1) per dimension ``dim`` (drawn from ``(fleet_seed, b, dim)``); unit ``u`` takes stratum
    ``perm[u % block]`` and the unit's own uniform sample ``x`` in [-1, 1] places it inside the stratum. So every
    aligned block (training units 0-3, held-out units 100-103) covers each range once per stratum, like a Latin
    hypercube sample (McKay, Beckman & Conover, Technometrics 1979), while units of different blocks differ.
    """
    b, k = divmod(int(unit_id), int(block))
    perm = np.random.default_rng([int(fleet_seed), 7919, b, int(dim)]).permutation(int(block))
    frac = min(max((float(x) + 1.0) / 2.0, 0.0), 1.0 - 1e-12)
    return -1.0 + 2.0 * (int(perm[k]) + frac) / int(block)


def _zero_cameras() -> dict[str, tuple[float, float, float]]:
    return {c: (0.0, 0.0, 0.0) for c in CAMERAS}


@dataclasses.dataclass(frozen=True)
class RobotUnit:
    """One robot of the fleet and its variation from the nominal Meta-World Sawyer.

    Attributes:
        unit_id: integer id of the robot.
        embodiment: robot type name (``"sawyer"`` for Meta-World).
        fleet_seed: seed the variation was drawn from, with ``unit_id``.
        camera_pos_offset_m: {camera: (3,) offset of the camera position in its parent frame, metres}.
        camera_rot_offset_deg: {camera: (3,) extrinsic xyz Euler angles of an extra camera rotation, degrees}.
        light_scale: factor on every light's (and the headlight's) diffuse intensity.
        table_rgb_delta, object_rgb_delta: (3,) RGB shift of table / task-object colours, in [0, 1] colour units.
        mass_scale, friction_scale: factors on task-object masses (and inertias) / sliding friction.
        action_gain: (3,) per-axis factor on the end-effector displacement per action unit (Meta-World: 1 cm).
        action_latency: control steps (12.5 ms each) between choosing an action and its execution, 0..max:
            ``unit_id % (action_latency_max + 1)``, stratified so training and held-out units cover the same
            latencies.
        obs_noise_std: std of Gaussian noise on the position entries of state observations, metres.

    With ``robot.stratify_block`` = B > 1 (the default config: 4), mass, friction, the three action gains and the
    observation noise are stratified over blocks of B consecutive ids (``_stratified``): each aligned block of B
    units covers each of those ranges once per stratum. Independent uniform draws once gave the four training
    units 0-3 friction 1.10-1.19 and the four held-out units 0.82-1.02 (docs/RESULTS.md, experiment 14).
    """

    unit_id: int
    embodiment: str = "sawyer"
    fleet_seed: int = 0
    camera_pos_offset_m: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=_zero_cameras)
    camera_rot_offset_deg: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=_zero_cameras)
    light_scale: float = 1.0
    table_rgb_delta: tuple[float, float, float] = (0.0, 0.0, 0.0)
    object_rgb_delta: tuple[float, float, float] = (0.0, 0.0, 0.0)
    mass_scale: float = 1.0
    friction_scale: float = 1.0
    action_gain: tuple[float, float, float] = (1.0, 1.0, 1.0)
    action_latency: int = 0
    obs_noise_std: float = 0.0

    @classmethod
    def draw(cls, unit_id: int, robot_cfg: Any = None) -> RobotUnit:
        """Draw unit ``unit_id``'s variation deterministically from ``(robot_cfg.fleet_seed, unit_id)``.

        ``robot_cfg`` None gives the nominal robot. Raises ValueError for a negative id or bad ranges.
        """
        if isinstance(unit_id, bool) or not isinstance(unit_id, (int, np.integer)) or unit_id < 0:
            raise ValueError(f"unit_id must be a non-negative int, given {unit_id!r}")
        cfg = as_dict(robot_cfg) if robot_cfg is not None else _NOMINAL_CFG
        r = _variation_ranges(cfg)
        fleet_seed = int(cfg.get("fleet_seed", 0))
        rng = np.random.default_rng([fleet_seed, int(unit_id)])
        u = lambda *shape: rng.uniform(-1.0, 1.0, size=shape)
        cam_pos, cam_rot = u(len(CAMERAS), 3), u(len(CAMERAS), 3)
        light, table_rgb, obj_rgb = u(), u(3), u(3)
        mass, friction, gain = u(), u(), u(3)
        latency_u, noise_u = rng.uniform(), rng.uniform()
        block = _stratify_block(cfg)
        if block > 1:   # Latin hypercube per block of ids: the unit's own draw only places it inside its stratum
            mass, friction, g0, g1, g2, noise = (
                _stratified(x, unit_id, block, fleet_seed, dim)
                for dim, x in enumerate((mass, friction, gain[0], gain[1], gain[2], 2.0 * noise_u - 1.0)))
            gain, noise_u = np.array([g0, g1, g2]), (noise + 1.0) / 2.0
        tup = lambda a: tuple(float(x) for x in a)
        return cls(
            unit_id=int(unit_id), embodiment=str(cfg.get("embodiment", "sawyer")), fleet_seed=fleet_seed,
            camera_pos_offset_m={c: tup(cam_pos[i] * r["camera_pos_mm"] / 1000.0) for i, c in enumerate(CAMERAS)},
            camera_rot_offset_deg={c: tup(cam_rot[i] * r["camera_rot_deg"]) for i, c in enumerate(CAMERAS)},
            light_scale=float(1.0 + light * r["light"]),
            table_rgb_delta=tup(table_rgb * r["color"]), object_rgb_delta=tup(obj_rgb * r["color"]),
            mass_scale=float(1.0 + mass * r["mass_scale"]), friction_scale=float(1.0 + friction * r["friction_scale"]),
            action_gain=tup(1.0 + gain * r["action_gain"]),
            # stratified over unit ids, not drawn: any L consecutive ids cover every latency 0..max, so training
            # and held-out units see the same latencies (a uniform draw once left 3 of 4 held-out units at a
            # latency no training unit had); ``latency_u`` is still drawn to keep the other fields' stream
            action_latency=int(unit_id) % (int(r["action_latency_max"]) + 1) if latency_u >= 0 else 0,
            obs_noise_std=float(noise_u * r["obs_noise_std"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field (tuples become lists)."""
        return json_safe(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RobotUnit:
        """Inverse of ``to_dict``. Raises ValueError on unknown keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"RobotUnit.from_dict: unknown keys {unknown}; expected {sorted(names)}")
        kw = dict(d)
        for k in ("table_rgb_delta", "object_rgb_delta", "action_gain"):
            if k in kw:
                kw[k] = tuple(kw[k])
        for k in ("camera_pos_offset_m", "camera_rot_offset_deg"):
            if k in kw:
                kw[k] = {c: tuple(v) for c, v in kw[k].items()}
        return cls(**kw)


def json_safe(x: Any) -> Any:
    """Tuples/arrays -> lists, numpy scalars -> Python scalars, recursively."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def _quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamilton product of MuJoCo (w, x, y, z) quaternions."""
    w1, x1, y1, z1 = a
    w2, x2, y2, z2 = b
    return np.array([w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2, w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
                     w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2, w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2])


class ModelVariation:
    """Writes a ``RobotUnit`` onto a Meta-World MuJoCo model, always starting from nominal values stored once.

    Table geoms are those of body ``tablelink``; task objects are every body tree hanging from the world other
    than the table, the retaining wall, the robot (``base``) and the ``mocap`` body. Geom colours are shifted
    from their effective nominal colour (the geom's rgba, or its material's when the geom keeps MuJoCo's
    default rgba); a shift that would leave [0, 1] is reflected back inside. Object masses and inertias scale
    by ``mass_scale``, object sliding friction by ``friction_scale``; ``mj_setConst`` then refreshes derived
    constants. Camera jitter is applied in the camera's parent frame: pos + offset, quat * R(euler_xyz).
    """

    def __init__(self, model) -> None:
        import mujoco

        self.model = model
        m = model
        robot_root = m.body("base").id
        table = m.body("tablelink").id
        skip_roots = {0, robot_root, table}
        for name in ("RetainingWall", "mocap"):
            try:
                skip_roots.add(m.body(name).id)
            except KeyError:
                pass
        roots = m.body_rootid
        self.object_bodies = np.array([b for b in range(1, m.nbody) if roots[b] not in skip_roots], dtype=int)
        is_obj_body = np.isin(m.geom_bodyid, self.object_bodies)
        self.object_geoms = np.flatnonzero(is_obj_body)
        self.table_geoms = np.flatnonzero(m.geom_bodyid == table)
        self.object_collision_geoms = np.flatnonzero(is_obj_body & ((m.geom_contype | m.geom_conaffinity) != 0))
        self.cameras = {c: m.camera(c).id for c in CAMERAS if _has(m, mujoco.mjtObj.mjOBJ_CAMERA, c)}
        rgba = m.geom_rgba.copy()
        default = np.all(np.isclose(rgba, [0.5, 0.5, 0.5, 1.0]), axis=1) & (m.geom_matid >= 0)
        rgba[default] = m.mat_rgba[m.geom_matid[default]]
        self.nominal = {
            "cam_pos": m.cam_pos.copy(), "cam_quat": m.cam_quat.copy(), "light_diffuse": m.light_diffuse.copy(),
            "headlight_diffuse": m.vis.headlight.diffuse.copy(), "geom_rgba": m.geom_rgba.copy(),
            "effective_rgba": rgba, "body_mass": m.body_mass.copy(), "body_inertia": m.body_inertia.copy(),
            "geom_friction": m.geom_friction.copy(),
        }

    def apply(self, unit: RobotUnit, data=None) -> None:
        """Set the model's varied fields to nominal-plus-``unit`` (idempotent); ``data`` for ``mj_setConst``."""
        import mujoco
        from scipy.spatial.transform import Rotation

        m, nom = self.model, self.nominal
        m.cam_pos[:] = nom["cam_pos"]
        m.cam_quat[:] = nom["cam_quat"]
        for c, i in self.cameras.items():
            m.cam_pos[i] += np.asarray(unit.camera_pos_offset_m.get(c, (0.0, 0.0, 0.0)))
            rot = np.asarray(unit.camera_rot_offset_deg.get(c, (0.0, 0.0, 0.0)))
            if np.any(rot):
                x, y, z, w = Rotation.from_euler("xyz", rot, degrees=True).as_quat()
                q = _quat_mul(nom["cam_quat"][i], np.array([w, x, y, z]))
                m.cam_quat[i] = q / np.linalg.norm(q)
        m.light_diffuse[:] = nom["light_diffuse"] * unit.light_scale
        m.vis.headlight.diffuse[:] = nom["headlight_diffuse"] * unit.light_scale
        m.geom_rgba[:] = nom["geom_rgba"]
        for geoms, delta in ((self.table_geoms, unit.table_rgb_delta), (self.object_geoms, unit.object_rgb_delta)):
            if len(geoms) and np.any(delta):
                base, d = nom["effective_rgba"][geoms, :3], np.asarray(delta)
                shifted = np.where((base + d < 0) | (base + d > 1), base - d, base + d)
                m.geom_rgba[geoms, :3] = np.clip(shifted, 0.0, 1.0)
                m.geom_rgba[geoms, 3] = nom["effective_rgba"][geoms, 3]
        m.body_mass[:] = nom["body_mass"]
        m.body_inertia[:] = nom["body_inertia"]
        m.body_mass[self.object_bodies] *= unit.mass_scale
        m.body_inertia[self.object_bodies] *= unit.mass_scale
        m.geom_friction[:] = nom["geom_friction"]
        m.geom_friction[self.object_collision_geoms, 0] *= unit.friction_scale
        if data is not None:
            mujoco.mj_setConst(m, data)


def _has(model, objtype, name: str) -> bool:
    import mujoco

    return mujoco.mj_name2id(model, objtype, name) >= 0


def embodiment_onehot(embodiment: str) -> np.ndarray:
    """``observation.embodiment``: (len(EMBODIMENTS),) float32 one-hot of ``embodiment`` (a mixed fleet's policy
    reads which robot it drives; ``obs.embodiment_feature``).

    Raises:
        ValueError: an embodiment not in :data:`EMBODIMENTS` (they are listed)."""
    if embodiment not in EMBODIMENTS:
        raise ValueError(f"unknown embodiment {embodiment!r}; known: {', '.join(EMBODIMENTS)}")
    out = np.zeros(len(EMBODIMENTS), np.float32)
    out[EMBODIMENTS.index(embodiment)] = 1.0
    return out


def embodiment_spec() -> dict:
    """The spec entry of ``observation.embodiment`` (:func:`embodiment_onehot`)."""
    return {"shape": [len(EMBODIMENTS)], "dtype": "float32", "names": list(EMBODIMENTS), "unit": "one-hot"}


def feature_spec(state_names: list[str], env_state_names: list[str], action_names: list[str], state_unit: str,
                 action_unit: str, cameras: list[str] | None, image_hw: tuple[int, int], control_hz: float) -> dict:
    """The JSON-able feature spec every sim env returns from ``spec_dict()`` (docs/INTERFACES.md).

    Args:
        state_names / env_state_names / action_names: per-dimension names of ``observation.state`` (4),
            ``observation.environment_state`` and ``action`` (4: dx, dy, dz relative; gripper absolute).
        state_unit / action_unit: human-readable units of the state and action.
        cameras: camera names with an ``observation.images.<camera>`` feature (uint8 HWC), or None.
        image_hw: (height, width) of those images, pixels.
        control_hz: control frequency, Hz.
    """
    spec: dict = {
        "observation.state": {"shape": [len(state_names)], "dtype": "float32", "names": state_names,
                              "unit": state_unit},
        "observation.environment_state": {"shape": [len(env_state_names)], "dtype": "float32",
                                          "names": env_state_names, "unit": "m (quaternion entries unitless)"},
    }
    for c in cameras or []:
        spec[f"observation.images.{c}"] = {"shape": [*image_hw, 3], "dtype": "uint8",
                                           "names": ["height", "width", "channel"], "unit": "rgb"}
    spec["action"] = {"shape": [len(action_names)], "dtype": "float32", "names": action_names, "low": -1.0,
                      "high": 1.0, "relative_dims": [0, 1, 2], "absolute_dims": [3], "unit": action_unit}
    spec["control_hz"] = control_hz
    return json_safe(spec)
