"""The fleet's Zarr experience store: many writers, crash-safe commits, snapshot readers.

Layout under the store URL (any fsspec URL; a plain path or ``file://`` uses zarr's ``LocalStore``)::

    zarr.json                               root group; attributes["fleetmind"] = store metadata (schema
                                            version, observation/action spec, control_hz, progress keys,
                                            packed_keys)
    shards/<writer_id>/lowdim/...           one appendable (rows, D) float32 Zarr array holding every float32
                                            feature of at most one dimension as columns, in ``packed_keys``
                                            order: state vectors, ``action``, ``reward``, ``progress.<k>``
    shards/<writer_id>/<key>/...            one appendable Zarr array per other feature key (images); rows = steps
                                            (episode ``start`` rows are multiples of the biggest image array's
                                            chunk rows; rows between episodes are zero padding)
    commits/<writer_id>/<episode_id>.json   one commit record per episode  <- the commit point
    annotations/<writer_id>/<episode_id>.json   failure-onset annotations (written by failure analysis)
    locks/<writer_id>.lock                  (local filesystems) flock held by the live writer

Schema versions: 2 (this layout) is written; 1 (one array per feature key, statistics sketches as JSON lists)
is still read, but not appended to (:class:`SchemaVersionError`). The public API is the same for both:
per-step *feature keys* (``reward``, ``progress.<k>`` included), whatever array holds them.

Why this is crash-safe (zarr 3 needs one writer per array, see docs/DEPENDENCIES.md):

- Each writer id owns its shard; no two processes append to one array (enforced with ``flock`` on local
  filesystems; elsewhere writer ids must be unique, e.g. one per fleet unit).
- Rows are written as whole chunks. On a local filesystem a chunk is encoded and written (by a small thread
  pool) as soon as the open episode's steps fill it; ``commit`` writes the rest (the last, partly filled
  chunk, zero-padded), waits for every chunk write, then writes the episode's commit record as one atomic
  write (temp file + ``os.replace`` locally, a single PUT on object stores). Readers only ever look at rows
  named by commit records, so an episode is visible exactly when its record exists.
- A chunk that already holds committed rows (the shard's partly filled last chunk) is only ever replaced
  through a temp file + atomic rename (``renameat2(RENAME_EXCHANGE)`` with a per-array spare file where
  available, else ``os.replace``), so a reader never sees it torn; chunks holding only uncommitted rows are
  written in place (no reader reads them).
- A writer killed at any point leaves at most rows past its last committed row (and stray ``*.partial``
  temp files). Reopening the writer truncates every array of its shard back to the committed row count
  (which deletes chunks wholly past it).
- Committed rows are never rewritten with different values, so a reader's snapshot (the set of commit
  records it has read) stays valid while writers append; :meth:`ExperienceStore.refresh` reads new records.
- Object stores (and ``memory://``) have no rename, so a chunk holding committed rows cannot be swapped in
  atomically beside a record, and two writes cost two round trips. There the ``lowdim`` rows of an episode
  travel inside its commit record (one PUT: the commit point and the data at once), and a ``lowdim`` chunk
  is written once, when the episodes have filled it, before the record that commits past it. So every
  chunk wholly below a shard's last committed row exists with its final content; the rows after it are
  read from the records (``reader.py``: ``_sealed``, ``_read_array``), and a reopened writer rebuilds its
  partly filled chunk from them. A chunk sealed by a writer killed before its record holds uncommitted
  rows past the commits: no reader takes it from the chunk, and the next seal rewrites it whole.

Durability against power loss would also need ``fsync`` of chunks; the guarantee here is against process
death (SIGKILL), which is what a fleet unit, the learner or the store writer meets in practice.

Code: ``schema.py`` (versions, errors, ``EpisodeMeta``, the array layout of a spec, sketch packing),
``storage.py`` (local / fsspec helpers, atomic writes, ``renameat2``), ``reader.py`` (``ExperienceStore``,
``copy_episodes``), ``writer.py`` (``EpisodeWriter``), ``zarr_compat.py`` (the only use of zarr's private APIs,
pinned to the minor it is tested with). This module gathers the public names.
"""

from __future__ import annotations

from experience_dict.store import *  # noqa: F403 - the public names, gathered in the package
from experience_dict.store import __all__  # noqa: F401
