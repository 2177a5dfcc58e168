"""The store's own zarr v3 codecs for camera frames, registered with zarr on import.

Each image array of a shard is ``(rows, H, W, C)`` uint8 in chunks of whole frames along time (``rows`` frames a
chunk). Consecutive frames of a robot's camera are nearly alike, which a per-chunk general-purpose compressor
exploits only in part. Two codecs use it (``store.image_codec``; measured in ``docs/PERFORMANCE.md``):

- :class:`FrameDeltaCodec` (``"fleetmind.frame_delta"``, an array -> array filter, **lossless**): each frame of a
  chunk minus the frame before it, modulo 256 (the chunk's first frame as it is), ahead of Blosc/zstd. Static
  background becomes runs of zeros. Decoding is a cumulative sum along time modulo 256, so frames come back bit
  for bit. The store's default for new stores (``image_codec="delta-zstd"``).
- :class:`VideoChunkCodec` (``"fleetmind.video"``, an array -> bytes serializer, **lossy**, opt-in with
  ``image_codec="h264"``): each chunk is one short H.264 stream (libx264 through PyAV, constant rate factor
  ``crf``, every chunk starting on a key frame, so each chunk decodes alone). This is what LeRobot's own recording
  does per episode (AV1 video); here the unit is the store's chunk, so random reads still decode one chunk.

A store written with these codecs names them in each array's ``zarr.json``; any process that reads it imports
this module first (``experience_dict.store`` does), otherwise zarr reports the codec name as unknown.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from zarr.abc.codec import ArrayArrayCodec, ArrayBytesCodec
from zarr.core.buffer import Buffer, NDBuffer
from zarr.core.common import JSON, parse_named_configuration
from zarr.registry import register_codec

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec

FRAME_DELTA = "fleetmind.frame_delta"
VIDEO = "fleetmind.video"


def _check_frames(shape: tuple[int, ...], dtype, name: str) -> None:
    np_dtype = dtype.to_native_dtype() if hasattr(dtype, "to_native_dtype") else np.dtype(dtype)
    if np_dtype != np.uint8 or len(shape) != 4:
        raise ValueError(f"codec {name} encodes camera frames: a (T, H, W, C) uint8 array, given shape {shape} "
                         f"dtype {np_dtype}")


class _SyncCodec:
    """zarr's async codec entry points on top of a codec's ``_encode_sync`` / ``_decode_sync`` (the work is CPU
    bound and short; zarr runs the codec pipeline in its own thread pool)."""

    async def _encode_single(self, chunk, chunk_spec):
        return self._encode_sync(chunk, chunk_spec)

    async def _decode_single(self, chunk, chunk_spec):
        return self._decode_sync(chunk, chunk_spec)


@dataclass(frozen=True)
class FrameDeltaCodec(_SyncCodec, ArrayArrayCodec):
    """Lossless temporal delta of a chunk of frames: ``d[0] = x[0]``, ``d[t] = x[t] - x[t-1]`` (mod 256).

    Input / output: ``(T, H, W, C)`` uint8 (same shape and dtype; only the values change). Meant ahead of a
    byte compressor (Blosc/zstd): on 96x96 Meta-World renders it takes zstd level 1 from 15x to ~18x on 37-frame
    chunks and to ~23x on 150-frame chunks (docs/PERFORMANCE.md). Decoding adds each frame to the one before in
    uint8, which wraps modulo 256, so it is exact. The same idea as PNG's "Sub" filter, along time.

    Raises:
        ValueError: the array is not 4-d uint8 (when the array is created).
    """

    is_fixed_size = True

    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        parse_named_configuration(data, FRAME_DELTA, require_configuration=False)
        return cls()

    def to_dict(self) -> dict[str, JSON]:
        return {"name": FRAME_DELTA}

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        _check_frames(tuple(shape), dtype, FRAME_DELTA)

    def resolve_metadata(self, chunk_spec: ArraySpec) -> ArraySpec:
        return chunk_spec

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> NDBuffer | None:
        x = np.asarray(chunk_array.as_numpy_array())
        d = np.empty_like(x)
        d[:1] = x[:1]
        np.subtract(x[1:], x[:-1], out=d[1:])   # uint8 arithmetic wraps modulo 256
        return chunk_spec.prototype.nd_buffer.from_numpy_array(d)

    def _decode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> NDBuffer:
        x = np.array(chunk_array.as_numpy_array(), copy=True)
        for t in range(1, len(x)):   # frame by frame: ~100x faster than numpy.cumsum(axis=0) on 12 KB frames
            np.add(x[t - 1], x[t], out=x[t])   # uint8: modulo 256
        return chunk_spec.prototype.nd_buffer.from_numpy_array(x)


    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return input_byte_length


def _av():
    try:
        import av
    except ImportError as e:   # pragma: no cover - av is in the [fleet] extra
        raise ImportError("store.image_codec=h264 needs PyAV (`pip install av`, in fleetmind's [fleet] extra)") from e
    return av


@dataclass(frozen=True)
class VideoChunkCodec(_SyncCodec, ArrayBytesCodec):
    """Lossy: a chunk of frames ``(T, H, W, 3)`` uint8 as one H.264 stream in an MP4 container (PyAV + libx264).

    Args:
        crf: libx264's constant rate factor (0-51; lower is better quality, 18 is commonly called visually
            lossless). On 96x96 Meta-World renders, CRF 18 in 37-frame chunks is ~37 KB an episode of 150 frames
            with a mean absolute error of ~3.5 grey levels, against LeRobot's AV1 at CRF 30 / GOP 2: ~140 KB and
            3.4 (docs/PERFORMANCE.md).
        preset: libx264's speed preset.
        pix_fmt: ``yuv420p`` (needs even H and W) or ``yuv444p`` (no chroma subsampling).

    Every chunk is its own stream and starts on a key frame, so a chunk decodes without its neighbours. Decoding
    returns the chunk's frames as RGB uint8 of the recorded shape; they differ from the recorded frames (lossy),
    so the store's bit-for-bit image checks do not hold for this codec.

    Raises:
        ValueError: the array is not ``(T, H, W, 3)`` uint8, or ``yuv420p`` with odd H or W (when created); a
            chunk that decodes to another shape (on read).
        ImportError: PyAV is not installed.
    """

    is_fixed_size = False
    crf: int = 18
    preset: str = "veryfast"
    pix_fmt: str = "yuv420p"

    def __post_init__(self) -> None:
        if not 0 <= int(self.crf) <= 51:
            raise ValueError(f"codec {VIDEO}: crf must be 0..51 (libx264), given {self.crf}")
        if self.pix_fmt not in ("yuv420p", "yuv444p"):
            raise ValueError(f"codec {VIDEO}: pix_fmt must be yuv420p or yuv444p, given {self.pix_fmt!r}")

    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        _, conf = parse_named_configuration(data, VIDEO, require_configuration=False)
        return cls(**(conf or {}))

    def to_dict(self) -> dict[str, JSON]:
        return {"name": VIDEO, "configuration": {"crf": int(self.crf), "preset": self.preset,
                                                  "pix_fmt": self.pix_fmt}}

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        _check_frames(tuple(shape), dtype, VIDEO)
        if shape[-1] != 3:
            raise ValueError(f"codec {VIDEO} encodes RGB frames (C = 3), given shape {tuple(shape)}")
        if self.pix_fmt == "yuv420p" and (shape[1] % 2 or shape[2] % 2):
            raise ValueError(f"codec {VIDEO}: yuv420p needs even frame sizes, given {shape[1]}x{shape[2]}; "
                             "use pix_fmt yuv444p")

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        av = _av()
        x = np.ascontiguousarray(chunk_array.as_numpy_array())
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4") as out:
            s = out.add_stream("libx264", rate=30)   # the rate only spaces timestamps; it is not the control rate
            s.width, s.height, s.pix_fmt = x.shape[2], x.shape[1], self.pix_fmt
            s.options = {"crf": str(int(self.crf)), "preset": self.preset}
            s.thread_type, s.codec_context.thread_count = "NONE", 1   # the writer's pool is the parallelism
            for frame in x:
                for packet in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    out.mux(packet)
            for packet in s.encode():
                out.mux(packet)
        return chunk_spec.prototype.buffer.from_bytes(buf.getvalue())

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        av = _av()
        with av.open(io.BytesIO(chunk_bytes.to_bytes()), "r") as inp:
            frames = [f.to_ndarray(format="rgb24") for f in inp.decode(video=0)]
        x = np.stack(frames) if frames else np.zeros((0,), np.uint8)
        if x.shape != tuple(chunk_spec.shape):
            raise ValueError(f"codec {VIDEO}: a chunk decoded to {x.shape}, expected {tuple(chunk_spec.shape)}")
        return chunk_spec.prototype.nd_buffer.from_numpy_array(x)


    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError(f"codec {VIDEO} has no fixed encoded size")


register_codec(FRAME_DELTA, FrameDeltaCodec)
register_codec(VIDEO, VideoChunkCodec)

IMAGE_CODECS = ("zstd", "delta-zstd", "h264")
"""``store.image_codec`` values: ``zstd`` (frames as they are, Blosc/zstd; every store before 2026-12-05),
``delta-zstd`` (:class:`FrameDeltaCodec` then Blosc/zstd; lossless; the default for new stores), ``h264``
(:class:`VideoChunkCodec`; lossy)."""

LOSSY_IMAGE_CODECS = ("h264",)
"""``image_codec`` values whose frames read back approximately."""
LOSSY_MEAN_TOL = 8.0
"""Grey levels: how far an episode's per-channel image mean read back through a lossy codec may be from the mean
its commit record holds. Measured at CRF 18 on push-v3 renders: 0.6-2.1 grey levels (48x48 and 96x96; the mean
absolute error per pixel is 3.5-4.9, partly a fixed shift from the RGB -> YUV conversion), so 8 leaves a margin of
~4x; a chunk of another episode is caught when its mean differs by more, which is not sure for a like scene. The
check takes the mean *luma* only (BT.601 weights, :data:`LUMA`, of the per-channel means): H.264's 4:2:0 chroma
subsampling keeps luma at full resolution, while saturated colour detail moves single channels far: a 1-pixel
red / green checker at CRF 18 moves the blue mean of the whole frame by 18 grey levels and, on the statistics'
every-4th-pixel subsample (which aliases with the checker), the red mean by 165, while the luma of that subsample
moves by 3 (issue 52, item 5)."""
LUMA = np.array([0.299, 0.587, 0.114])
"""BT.601 luma weights of (R, G, B)."""

__all__ = ["FRAME_DELTA", "IMAGE_CODECS", "LOSSY_IMAGE_CODECS", "LOSSY_MEAN_TOL", "LUMA", "VIDEO", "FrameDeltaCodec", "VideoChunkCodec"]


POINT_GRID = "fleetmind.point_grid"
POINT_GRID_MAX = 32767
"""The largest grid index an int16 holds: a coordinate of at most ``POINT_GRID_MAX * grid_m`` metres in magnitude."""


def grid_indices(x, grid_m: float) -> np.ndarray:
    """Float64 grid indices ``rint(x / grid_m)`` of coordinates ``x`` (metres, any shape).

    Raises:
        ValueError: a coordinate beyond the int16 grid (``POINT_GRID_MAX * grid_m``)."""
    x = np.asarray(x, dtype=np.float64)
    k = np.rint(x / grid_m)
    if k.size and np.abs(k).max() > POINT_GRID_MAX:
        raise ValueError(f"a coordinate of {np.abs(x).max():.4f} m is beyond the int16 point grid's "
                         f"{POINT_GRID_MAX * grid_m:.4f} m (at {grid_m} m)")
    return k


@dataclass(frozen=True)
class PointGridCodec(_SyncCodec, ArrayBytesCodec):
    """Lossless for points on a grid: float32 coordinates that are multiples of ``grid_m`` metres (as
    ``sim.pointcloud.snap_to_grid`` makes them, and the writer snaps a ``grid_m`` feature to) stored as little-endian
    int16 grid indices (``rint(x / grid_m)``), half of float32's bytes, ahead of a byte-shuffled Blosc/zstd.

    Decoding gives ``float32(k * grid_m)`` computed in float64: exactly the snapped values. A depth camera's
    point cloud in farthest-point order has no order a compressor can use; the 2-byte integers and the shuffle are
    what it gets (docs/STORAGE.md). At the default 0.1 mm grid an int16 holds +-3.2767 m.

    Raises:
        ValueError: the array is not float32 (when created); a coordinate beyond the int16 range (when written).
    """

    grid_m: float = 1e-4
    is_fixed_size = True

    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        _, cfg = parse_named_configuration(data, POINT_GRID, require_configuration=True)
        return cls(grid_m=float(cfg["grid_m"]))

    def to_dict(self) -> dict[str, JSON]:
        return {"name": POINT_GRID, "configuration": {"grid_m": self.grid_m}}

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        np_dtype = dtype.to_native_dtype() if hasattr(dtype, "to_native_dtype") else np.dtype(dtype)
        if np_dtype != np.float32:
            raise ValueError(f"codec {POINT_GRID} encodes float32 coordinates, given dtype {np_dtype}")

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        try:
            k = grid_indices(chunk_array.as_numpy_array(), self.grid_m)
        except ValueError as e:
            raise ValueError(f"codec {POINT_GRID}: {e}") from None
        return chunk_spec.prototype.buffer.from_bytes(k.astype("<i2").tobytes())

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        k = np.frombuffer(chunk_bytes.to_bytes(), dtype="<i2").reshape(chunk_spec.shape)
        x = (k.astype(np.float64) * self.grid_m).astype(np.float32)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(x)


    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        return input_byte_length // 2


register_codec(POINT_GRID, PointGridCodec)
__all__ += ["POINT_GRID", "POINT_GRID_MAX", "PointGridCodec", "grid_indices"]
