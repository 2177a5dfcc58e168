"""The one place the store touches zarr's private or unstable APIs (zarr 3.1, the minor it is tested with).

- :func:`sync_chunk_encoder`: encodes one whole chunk with the array's own codec chain in the calling thread
  (``SupportsSyncCodec`` / ``Codec._encode_sync``, ``metadata.get_chunk_spec``), so the store's writer threads
  write exactly the bytes zarr's async pipeline would, without an event-loop round trip per chunk;
- :func:`zarr_sync`: runs a coroutine on zarr's own event loop (``zarr.core.sync.sync``), used for resizes
  and remote writes through ``AsyncArray``.

``pyproject.toml`` pins ``zarr>=3.1,<3.2``; :func:`check` (run by ``tests/test_store.py``) fails loudly, naming
the missing attribute, when a zarr release moves one of these, instead of the store breaking deep inside a
commit.
"""

from __future__ import annotations

import numpy as np
import zarr
from zarr.abc.codec import SupportsSyncCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync as zarr_sync

TESTED_MINOR = (3, 1)


def sync_chunk_encoder(arr: zarr.Array, on_drop=None):
    """A function encoding one whole chunk of ``arr`` (``(chunk_rows, *shape)`` array) to the bytes zarr stores.

    Runs the array's own codec chain (bytes -> Blosc -> crc32c here) through zarr's synchronous codec interface
    (``zarr.abc.codec.SupportsSyncCodec``) in the calling thread, so the result is exactly what zarr's async
    pipeline would write. Returns ``None`` when a codec has no synchronous form (callers then use zarr's
    ``setitem``). ``on_drop(codec)``: the exception to raise when a codec returns no bytes.
    """
    aa = arr.async_array
    codecs = list(aa.codec_pipeline)
    if not all(isinstance(c, SupportsSyncCodec) for c in codecs):
        return None
    spec0 = aa.metadata.get_chunk_spec((0,) * arr.ndim, aa.config, default_buffer_prototype())
    specs, spec = [], spec0
    for c in codecs:  # each codec sees the spec resolved by the codecs before it, as in zarr's pipeline
        specs.append(spec)
        spec = c.resolve_metadata(spec)

    def encode(block: np.ndarray):
        buf = spec0.prototype.nd_buffer.from_numpy_array(block)
        for c, s in zip(codecs, specs):
            buf = c._encode_sync(buf, s)
            if buf is None:
                raise (on_drop(c) if on_drop else RuntimeError(f"codec {c} dropped a chunk of {arr.path}"))
        return buf.as_buffer_like()

    return encode


def check() -> None:
    """Raise ``RuntimeError`` naming what moved when the installed zarr lacks an API this module uses, or is not
    the minor release it is tested with."""
    major_minor = tuple(int(x) for x in zarr.__version__.split(".")[:2])
    if major_minor != TESTED_MINOR:
        raise RuntimeError(f"zarr {zarr.__version__}: experience_dict.store is tested with zarr "
                           f"{'.'.join(map(str, TESTED_MINOR))}.x (its private codec/sync APIs); re-test and update "
                           "experience_dict/store/zarr_compat.py")
    from zarr.codecs import BloscCodec, Crc32cCodec

    try:   # the store's own use, end to end: a chunk encoded here must be byte for byte what zarr writes
        store = zarr.storage.MemoryStore()
        arr = zarr.create_array(store, name="a", shape=(8, 3), chunks=(4, 3), dtype="float32", fill_value=0,
                                compressors=[BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"), Crc32cCodec()])
        encode = sync_chunk_encoder(arr)
        block = np.arange(12, dtype=np.float32).reshape(4, 3)
        arr[0:4] = block
        key = "a/" + arr.metadata.encode_chunk_key((0, 0))
        written = zarr_sync(store.get(key, prototype=default_buffer_prototype()))
        zarr_sync(arr.async_array.resize((4, 3), delete_outside_chunks=False))
    except (AttributeError, TypeError) as e:
        raise RuntimeError(f"zarr {zarr.__version__}: an API experience_dict.store relies on moved: {e}") from e
    if encode is None:
        raise RuntimeError(f"zarr {zarr.__version__}: the store's codecs lost their synchronous encoders "
                           "(SupportsSyncCodec._encode_sync)")
    if bytes(encode(block)) != written.to_bytes():
        raise RuntimeError(f"zarr {zarr.__version__}: a chunk encoded through the synchronous codec chain differs "
                           "from the chunk zarr writes")


__all__ = ["TESTED_MINOR", "check", "sync_chunk_encoder", "zarr_sync"]
