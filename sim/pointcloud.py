"""Depth cameras turned into a workspace point cloud: what a robot's RGB-D sensor gives, in the robot's base frame.

After 3D Diffusion Policy (DP3; Ze et al., RSS 2024): one or more depth images are back-projected with the camera's
pinhole model, expressed in the robot's base frame, cropped to the workspace box (which drops the table top, the
floor and the background), and reduced to a fixed number of points by farthest-point sampling (FPS). DP3 uses 512 or
1,024 points and no colour; so does this module. FPS is the ``fpsample`` library's (``bucket_fps_kdline_sampling``,
a bucket-based exact FPS; deterministic for a given cloud and start index).

The MuJoCo depth buffer (``mujoco.Renderer.enable_depth_rendering``) is linear depth in metres along the camera's
optical axis; MuJoCo cameras look along their local -z with +y up and +x to the right, and the renderer's image has
row 0 at the top. A pixel (row i, column j) of an H x W image with vertical field of view ``fovy`` is the ray
``x = (j + 0.5 - W/2) d / f``, ``y = -(i + 0.5 - H/2) d / f``, ``z = -d`` with ``f = (H/2) / tan(fovy/2)`` pixels.
Points are snapped to a grid of ``GRID_M`` (0.1 mm, below a RealSense D435's depth resolution) so that the store can
keep them as 16-bit integers losslessly (``experience_dict.store.codecs.PointGridCodec``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

GRID_M = 1e-4
"""Point coordinates are multiples of this, metres (the store's lossless int16 grid: +-3.27 m)."""


def snap_to_grid(points: np.ndarray, grid: float = GRID_M) -> np.ndarray:
    """``points`` rounded to multiples of ``grid`` metres: float32 ``k * grid`` computed in float64 (the store's
    ``PointGridCodec`` decodes to exactly these values). Any shape; returns float32 of the same shape."""
    return (np.rint(np.asarray(points, dtype=np.float64) / grid) * grid).astype(np.float32)


@dataclass(frozen=True)
class CloudSpec:
    """How a point cloud is made (the ``obs`` group's ``point_*`` options).

    Attributes:
        cameras: depth cameras whose points are merged (names of the embodiment's model).
        image_hw: depth image (height, width), pixels.
        num_points: points after farthest-point sampling, N.
        crop_min, crop_max: the workspace box in the robot's base frame, metres (x, y, z); points outside are dropped.
        base_body: the robot's base body in the MuJoCo model: points are expressed in its frame.
    """

    cameras: tuple[str, ...]
    image_hw: tuple[int, int]
    num_points: int
    crop_min: tuple[float, float, float]
    crop_max: tuple[float, float, float]
    base_body: str

    def __post_init__(self) -> None:
        if not self.cameras:
            raise ValueError("obs.point_cameras: name at least one depth camera")
        if len(self.image_hw) != 2 or min(self.image_hw) <= 0:
            raise ValueError(f"obs.point_image_size: expected a positive int or [height, width], given {self.image_hw}")
        if self.num_points < 1:
            raise ValueError(f"obs.num_points: expected >= 1, given {self.num_points}")
        lo, hi = np.asarray(self.crop_min, float), np.asarray(self.crop_max, float)
        if lo.shape != (3,) or hi.shape != (3,) or not np.all(np.isfinite(lo)) or not np.all(np.isfinite(hi)) \
                or np.any(lo >= hi):
            raise ValueError(f"obs.crop_min / crop_max: expected finite (x, y, z) metres with min < max per axis, "
                             f"given {self.crop_min} / {self.crop_max}")


def backproject(depth: np.ndarray, fovy_deg: float, cam_pos: np.ndarray, cam_mat: np.ndarray) -> np.ndarray:
    """World points of every pixel of a MuJoCo depth image.

    Args:
        depth: (H, W) float32 linear depth, metres (MuJoCo's renderer, row 0 at the top).
        fovy_deg: the camera's vertical field of view, degrees (``model.cam_fovy``).
        cam_pos: (3,) camera position, world frame, metres (``data.cam_xpos``).
        cam_mat: (3, 3) or (9,) camera orientation, world frame (``data.cam_xmat``; columns: camera x, y, z axes).

    Returns:
        (H * W, 3) float64 world points, metres, row-major over the image.
    """
    h, w = depth.shape
    f = 0.5 * h / np.tan(np.deg2rad(fovy_deg) / 2.0)
    jj, ii = np.meshgrid(np.arange(w) + 0.5 - w / 2.0, np.arange(h) + 0.5 - h / 2.0)
    d = depth.astype(np.float64)
    cam = np.stack([jj * d / f, -ii * d / f, -d], axis=-1).reshape(-1, 3)
    return cam @ np.asarray(cam_mat, dtype=np.float64).reshape(3, 3).T + np.asarray(cam_pos, dtype=np.float64)


def crop(points: np.ndarray, lo: Sequence[float], hi: Sequence[float]) -> np.ndarray:
    """The rows of (M, 3) ``points`` inside the box ``lo <= p <= hi`` (each (3,), same frame and unit)."""
    lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    keep = np.all((points >= lo) & (points <= hi), axis=1)
    return points[keep]


def farthest_points(points: np.ndarray, n: int, start: int = 0) -> np.ndarray:
    """``n`` rows of (M, 3) ``points`` by farthest-point sampling (``fpsample.bucket_fps_kdline_sampling``), in
    sampling order; deterministic for the same points and ``start`` (the first point's index, mod M). When M <= n
    every point is kept and the cloud is filled up by repeating it from its first point (a fixed N for the policy);
    an empty cloud gives (n, 3) zeros.

    Returns:
        (n, 3) array of ``points``' dtype.
    """
    m = len(points)
    if m == 0:
        return np.zeros((n, 3), dtype=points.dtype)
    if m <= n:
        return points[np.arange(n) % m]
    import fpsample

    idx = fpsample.bucket_fps_kdline_sampling(np.ascontiguousarray(points, dtype=np.float32), n, h=5,
                                              start_idx=int(start) % m)
    return points[np.asarray(idx, dtype=np.int64)]


class DepthPointCloud:
    """The workspace point cloud of one MuJoCo model's depth cameras (DP3's observation), in the robot's base frame.

    Args:
        model: the env's ``mujoco.MjModel`` (its offscreen buffer is enlarged to the depth image when needed).
        spec: :class:`CloudSpec`.
        renderer_kw: ``sim.gl.CameraRenderer`` keywords (shadows and reflections do not change depth).

    Raises:
        ValueError: a camera or the base body is not in the model.
        RuntimeError: no working offscreen GL backend (``sim.gl``).
    """

    def __init__(self, model, spec: CloudSpec, **renderer_kw) -> None:
        from sim.gl import CameraRenderer

        names = {model.camera(i).name for i in range(model.ncam)}
        missing = [c for c in spec.cameras if c not in names]
        if missing:
            raise ValueError(f"obs.point_cameras: {missing} not in the model; its cameras: {sorted(names)}")
        bodies = {model.body(i).name for i in range(model.nbody)}
        if spec.base_body not in bodies:
            raise ValueError(f"point cloud: base body {spec.base_body!r} is not in the model")
        self.spec = spec
        self._cam_ids = [model.camera(c).id for c in spec.cameras]
        self._base_id = model.body(spec.base_body).id
        self._model = model
        self._r = CameraRenderer(model, *spec.image_hw, rotated=frozenset(), depth=True, **renderer_kw)

    def world_points(self, data) -> np.ndarray:
        """(M, 3) float64 world points of every camera's every pixel (before the crop), metres."""
        out = []
        for c, cid in zip(self.spec.cameras, self._cam_ids):
            depth = self._r.render(data, c)
            out.append(backproject(depth, float(self._model.cam_fovy[cid]), data.cam_xpos[cid], data.cam_xmat[cid]))
        return np.concatenate(out, axis=0)

    def __call__(self, data) -> np.ndarray:
        """The observation ``observation.point_cloud``: (N, 3) float32, metres, the robot's base frame, cropped to
        the workspace, farthest-point sampled (N = ``spec.num_points``), snapped to :data:`GRID_M`."""
        pts = self.world_points(data)
        rot = np.asarray(data.xmat[self._base_id], dtype=np.float64).reshape(3, 3)
        pts = (pts - np.asarray(data.xpos[self._base_id], dtype=np.float64)) @ rot   # world -> base: R^T (p - x)
        pts = crop(pts, self.spec.crop_min, self.spec.crop_max)
        return snap_to_grid(farthest_points(pts, self.spec.num_points))

    def close(self) -> None:
        """Free the GL context (idempotent)."""
        self._r.close()


class CloudGrabber:
    """Point clouds of many envs through few GL contexts: one :class:`DepthPointCloud` per task model (a private
    copy), shared by every robot unit's env of that task, drawn with the env's own ``MjData`` (so with its unit's
    camera pose: a fixed camera's pose is in ``data.cam_xpos`` / ``cam_xmat``). What a robot's depth camera sees,
    for a success detector on any policy (``fleet.labels``); the :class:`sim.gl.FrameGrabber` of depth.

    Args:
        cameras: depth cameras merged. image_hw: depth image (height, width), pixels. num_points: N.
        crop_max: the workspace box's upper corner (base frame, metres) instead of the embodiment's (``POINT_CROP``).
    """

    def __init__(self, cameras: Sequence[str], image_hw: tuple[int, int], num_points: int,
                 crop_max: Sequence[float] | None = None) -> None:
        self.cameras, self.image_hw, self.num_points = tuple(cameras), tuple(int(s) for s in image_hw), int(num_points)
        self.crop_max = tuple(float(x) for x in crop_max) if crop_max is not None else None
        self._clouds: dict[str, DepthPointCloud] = {}

    def cloud(self, env) -> np.ndarray:
        """(N, 3) float32 metres in the robot's base frame: ``env``'s workspace cloud now (an env with ``task``,
        ``mj_model``, ``mj_data``, ``BASE_BODY`` and ``POINT_CROP``).

        Raises:
            RuntimeError: no working GL backend. ValueError: a camera the model lacks.
        """
        key = str(getattr(env, "task", id(env.mj_model)))
        if key not in self._clouds:
            import copy

            lo, hi = env.POINT_CROP
            spec = CloudSpec(self.cameras, self.image_hw, self.num_points, tuple(lo),
                             self.crop_max if self.crop_max is not None else tuple(hi), env.BASE_BODY)
            self._clouds[key] = DepthPointCloud(copy.deepcopy(env.mj_model), spec)
        return self._clouds[key](env.mj_data)

    def close(self) -> None:
        """Free every GL context (idempotent)."""
        for c in self._clouds.values():
            c.close()
        self._clouds.clear()
