"""Offscreen OpenGL for MuJoCo on CPU or GPU machines: backend choice, fast renderer set-up, upright images.

MuJoCo's Python bindings pick their GL backend from ``MUJOCO_GL`` once, when ``mujoco`` is first imported, and
``import mujoco`` itself fails when that backend's libraries are missing. ``select_backend()`` therefore runs
from ``sim/__init__.py`` before anything imports mujoco: it keeps ``MUJOCO_GL=egl`` (the default) when an EGL
display initialises, falls back to ``osmesa`` when only libOSMesa is present, and otherwise sets
``MUJOCO_GL=disable`` so that state-only envs still work; ``make_renderer`` then raises an error naming what to
install. An explicit ``MUJOCO_GL`` other than ``egl`` (``osmesa``, ``glfw``, ...) is respected unchanged.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import sys
import weakref

import numpy as np

INSTALL_HINT = (
    "Install an offscreen OpenGL backend: EGL (Debian/Ubuntu: `apt-get install libegl1 libgl1`, with Mesa "
    "or an NVIDIA driver) and run with MUJOCO_GL=egl, or OSMesa (`apt-get install libosmesa6`) and run with "
    "MUJOCO_GL=osmesa. State-only envs (obs.images=false) need no GL."
)
_backend_note: str | None = None  # why rendering is unavailable, if it is


def _egl_works() -> bool:
    """True when libEGL loads and one EGL device display initialises (the check MuJoCo's EGL context makes)."""
    name = ctypes.util.find_library("EGL")
    if name is None:
        return False
    try:
        egl = ctypes.CDLL(name)
        egl.eglGetProcAddress.restype = ctypes.c_void_p
        egl.eglGetProcAddress.argtypes = [ctypes.c_char_p]
        q_addr = egl.eglGetProcAddress(b"eglQueryDevicesEXT")
        d_addr = egl.eglGetProcAddress(b"eglGetPlatformDisplayEXT")
        if not q_addr or not d_addr:
            return False
        query = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.POINTER(ctypes.c_int))(q_addr)
        get_display = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p)(d_addr)
        devices, n = (ctypes.c_void_p * 8)(), ctypes.c_int(0)
        if not query(8, devices, ctypes.byref(n)):
            return False
        egl.eglInitialize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        egl.eglTerminate.argtypes = [ctypes.c_void_p]
        for i in range(n.value):
            display = get_display(0x313F, devices[i], None)  # EGL_PLATFORM_DEVICE_EXT
            if display and egl.eglInitialize(display, None, None):
                egl.eglTerminate(display)
                return True
    except (OSError, AttributeError):
        return False
    return False


def select_backend() -> str:
    """Choose ``MUJOCO_GL`` before mujoco is imported; returns the backend in effect.

    Order: an explicit non-egl ``MUJOCO_GL`` is kept; else ``egl`` if an EGL device initialises; else
    ``osmesa`` if libOSMesa is found; else ``disable`` (rendering raises ``RuntimeError`` with
    ``INSTALL_HINT``). If mujoco is already imported, its backend cannot change and is returned as is.
    """
    global _backend_note
    current = os.environ.get("MUJOCO_GL", "").lower().strip()
    if "mujoco" in sys.modules or (current and current != "egl"):
        return current or "glfw"
    if _egl_works():
        os.environ["MUJOCO_GL"] = "egl"
    elif ctypes.util.find_library("OSMesa"):
        os.environ["MUJOCO_GL"] = "osmesa"
        os.environ["PYOPENGL_PLATFORM"] = "osmesa"
        _backend_note = "EGL did not initialise; using OSMesa (slower)."
    else:
        os.environ["MUJOCO_GL"] = "disable"
        _backend_note = f"no EGL device and no libOSMesa found{' (MUJOCO_GL=egl requested)' if current else ''}."
    return os.environ["MUJOCO_GL"]


# Corner cameras in Meta-World's scene are rolled 180 degrees: their raw image is upside down *and* mirrored,
# so it is rotated back (a vertical flip alone would leave it mirrored). LeRobot's Meta-World env does the same.
ROTATED_CAMERAS = frozenset({"corner", "corner2", "corner3", "corner4"})

_live: weakref.WeakSet = weakref.WeakSet()
_atexit_registered = False


def _close_all() -> None:
    """Close live renderers; registered after mujoco's own EGL atexit hook so that it runs first (LIFO)."""
    for r in list(_live):
        r.close()


class CameraRenderer:
    """RGB renders of named cameras of one MuJoCo model, made fast for CPU rasterisers.

    Before the ``mujoco.Renderer`` (and its GL context) is created, the model's shadow map is shrunk to
    ``shadowsize`` and multisampling (``offsamples``) is set to 0; shadows and reflections are scene flags
    (off by default: on llvmpipe they cost ~3x). Figures: docs/DEPENDENCIES.md.

    Args:
        model: ``mujoco.MjModel`` (its ``vis.quality`` fields are modified).
        height, width: image size in pixels.
        shadows, reflections: render shadows / floor reflections.
        shadowsize: shadow map size in texels (MuJoCo default 4096).
        rotated: camera names whose raw image is rolled 180 degrees in this model (Meta-World's ``corner*``, the
            default; the SO-100 twin's cameras are upright: none).
        depth: render linear depth (metres along the optical axis, (H, W) float32, as the raw buffer: never turned)
            instead of RGB (``sim.pointcloud``).

    Raises:
        RuntimeError: no working GL backend; the message says what to install.
    """

    def __init__(self, model, height: int, width: int, shadows: bool = False, reflections: bool = False,
                 shadowsize: int = 256, rotated: frozenset[str] = ROTATED_CAMERAS, depth: bool = False) -> None:
        import mujoco

        if os.environ.get("MUJOCO_GL", "").lower() in ("disable", "disabled", "off", "false", "0"):
            raise RuntimeError(f"offscreen rendering is unavailable: {_backend_note or 'MUJOCO_GL disables GL'} "
                               + INSTALL_HINT)
        model.vis.quality.shadowsize = int(shadowsize)
        model.vis.quality.offsamples = 0
        model.vis.global_.offwidth = max(int(model.vis.global_.offwidth), int(width))
        model.vis.global_.offheight = max(int(model.vis.global_.offheight), int(height))
        try:
            self._r = mujoco.Renderer(model, height=int(height), width=int(width))
        except Exception as e:  # GL context creation failed (EGL without device, OSMesa missing, ...)
            raise RuntimeError(f"could not create a MuJoCo offscreen renderer with "
                               f"MUJOCO_GL={os.environ.get('MUJOCO_GL')!r}: {e}. " + INSTALL_HINT) from e
        if depth:
            self._r.enable_depth_rendering()
        self.depth = bool(depth)
        self._r.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = bool(shadows)
        self._r.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = bool(reflections)
        self.height, self.width = int(height), int(width)
        self.rotated = frozenset(rotated)
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True
        _live.add(self)

    def render(self, data, camera: str) -> np.ndarray:
        """Render ``camera`` of the current ``data``; (H, W, 3) uint8 RGB, upright (``rotated`` cameras turned
        back 180°); a depth renderer: (H, W) float32 metres, as rendered."""
        self._r.update_scene(data, camera=camera)
        img = self._r.render()
        if self.depth:
            return img
        if camera in self.rotated:
            img = np.flip(img, (0, 1))
        return np.ascontiguousarray(img)

    def render_rgbd(self, data, camera: str) -> tuple[np.ndarray, np.ndarray]:
        """A depth renderer's colour and depth of ``camera`` from one scene update: ((H, W, 3) uint8 RGB, (H, W)
        float32 metres), both as rendered (never turned, so pixel (v, u) of one is pixel (v, u) of the other: what
        an RGB-D sensor's depth-aligned colour stream gives). The colour pass shares this renderer's GL context.

        Raises:
            ValueError: a renderer made without ``depth=True``."""
        if not self.depth:
            raise ValueError("render_rgbd: this renderer was made for RGB only (depth=False)")
        self._r.update_scene(data, camera=camera)
        depth = self._r.render()
        self._r.disable_depth_rendering()
        try:
            rgb = np.ascontiguousarray(self._r.render())
        finally:
            self._r.enable_depth_rendering()
        return rgb, depth

    def close(self) -> None:
        """Free the GL context (idempotent)."""
        r, self._r = getattr(self, "_r", None), None
        if r is not None:
            try:
                r.close()
            except Exception:  # noqa: BLE001, S110 - a context already torn down by the driver
                pass


_VISUAL_FIELDS = ("cam_pos", "cam_quat", "light_diffuse", "geom_rgba")


class FrameGrabber:
    """Camera frames of many envs through few GL contexts: one :class:`CameraRenderer` per task model, shared by
    every robot unit's env of that task (a renderer per env costs a GL context each; a fleet process pools ~100 envs).

    A unit varies its model's cameras, lights and colours (``sim.units.ModelVariation``); before each render those
    fields (``cam_pos``, ``cam_quat``, ``light_diffuse``, ``geom_rgba`` and the headlight) are copied from the env's
    own model into the shared renderer's, and the env's ``MjData`` is drawn, so a frame is what that unit's own
    camera sees. What a robot's camera sees, for a success detector (``fleet.labels``) on a state-only policy.

    Args:
        height, width: frame size in pixels. rotated: as :class:`CameraRenderer`.
    """

    def __init__(self, height: int, width: int, rotated: frozenset[str] = ROTATED_CAMERAS) -> None:
        self.height, self.width, self.rotated = int(height), int(width), frozenset(rotated)
        self._renderers: dict[str, tuple[object, CameraRenderer]] = {}

    def frames(self, env, cameras: list[str]) -> np.ndarray:
        """(C, H, W, 3) uint8: ``cameras`` of ``env``'s current state (an env with ``task``, ``mj_model``,
        ``mj_data``; corner cameras upright, as the env's own).

        Raises:
            RuntimeError: no working GL backend. KeyError: a camera the model lacks.
        """
        m = env.mj_model
        key = str(getattr(env, "task", id(m)))
        if key not in self._renderers:
            import copy

            own = copy.deepcopy(m)   # a private model: the renderer's visual fields are overwritten per env
            rotated = getattr(env, "ROTATED_CAMERAS", self.rotated)
            self._renderers[key] = (own, CameraRenderer(own, self.height, self.width, rotated=rotated))
        own, r = self._renderers[key]
        for f in _VISUAL_FIELDS:
            getattr(own, f)[:] = getattr(m, f)
        own.vis.headlight.diffuse[:] = m.vis.headlight.diffuse
        return np.stack([r.render(env.mj_data, c) for c in cameras])

    def close(self) -> None:
        """Free every GL context (idempotent)."""
        for _, r in self._renderers.values():
            r.close()
        self._renderers.clear()
