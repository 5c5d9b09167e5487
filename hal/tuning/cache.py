"""The measured kernel choices of one device model, kept in memory and in one JSON file on disk.

Measuring the kernels that can run a call costs milliseconds, so each result is measured once per
device model and kept in ``<cache_dir()>/<device>-<digest>.json``. The digest is taken of the
``versions`` that make a measurement stale (hal, the plugins, torch, the driver): after an upgrade
the cache reads a different file, and old measurements are never served.

The file is shared by every process on the machine. It is read once, when a :class:`TuneCache` is
made, and again only inside :meth:`TuneCache.put`, under an exclusive ``flock`` on ``<file>.lock``:
the writer merges what is on disk with its own measurements and replaces the file atomically, so
concurrent processes lose no entry and a reader never sees half a file.

A cache must never stop a program: a file hal cannot use is ignored with one warning (and moved
aside to ``<file>.corrupt`` before the next write replaces it), a record whose fields do not hold
what the dispatcher reads (:data:`FIELDS`) is dropped with one warning per file naming the record
and the field (the call is measured again, and the next write leaves the record out), and a
directory hal cannot write leaves the measurements in memory for this process, again with one
warning.

A plugin may ship *seed* files, measured on the project's machines, in the same format. A seed is
matched by device only (its versions may be older); its records are served with ``"source":
"seed"`` until this machine measures the same key. :meth:`TuneCache.export` writes such a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

log = logging.getLogger("hal")

#: one measured choice, JSON-able, e.g. ``{"winner": "cuda/triton", "times_us": {...}, "context":
#: "eager", "measured": "2026-12-02T10:00:00Z", "source": "measured"}``
Record = dict[str, Any]

#: the file layout this module reads and writes; a file of another format is ignored.
FORMAT = 1


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_time(value: Any) -> bool:
    """Microseconds as the dispatcher writes them: a number >= 0, or "inf" (the kernel raised)."""
    if value == "inf":
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0  # NaN fails too


def _is_times(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _is_time(t) for k, t in value.items())


#: what each field of a record must hold, as (required, description, check): the dispatcher reads
#: ``winner`` and ``times_us`` (:mod:`hal.dispatch.measure`), reports print the others. Fields not
#: named here are kept as they are.
FIELDS: dict[str, tuple[bool, str, Callable[[Any], bool]]] = {
    "winner": (True, "the winning route's label, a string", _is_text),
    "times_us": (True, 'an object of route label -> microseconds (a number >= 0, or "inf")', _is_times),
    "context": (False, "a string", _is_text),
    "op": (False, "a string", _is_text),
    "source": (False, "a string", _is_text),
    "measured": (False, "a string (an ISO 8601 time)", _is_text),
}


def _record_problem(record: Any) -> Optional[str]:
    """Why ``record`` (parsed JSON) is not a usable record, naming the field; None if it is."""
    if not isinstance(record, dict):
        return f"not an object but {_shown(record)}"
    for field, (required, description, check) in FIELDS.items():
        if field not in record:
            if required:
                return f"field {field!r} is missing (it must be {description})"
        elif not check(record[field]):
            return f"field {field!r} must be {description}, got {_shown(record[field])}"
    return None


def _shown(value: Any) -> str:
    """A value as the file spells it, shortened."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: a device slug names a file, so it may not hold path separators or start with a dot.
_DEVICE_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

#: the (kind, path) pairs already warned about in this process: each problem is said once.
_warned: set[tuple[str, Path]] = set()
_warned_lock = threading.Lock()


def cache_dir() -> Path:
    """Where tuning caches live: ``$HAL_TUNE_CACHE`` if set, else ``~/.cache/hal/tune``."""
    configured = os.environ.get("HAL_TUNE_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "hal" / "tune"


class _Unusable(Exception):
    """A cache or seed file that exists but cannot be used; the message says why."""


class TuneCache:
    """The measured choices of one device model, in memory and in one JSON file.

    ``device`` is a slug such as ``"nvidia-h200-sm90"``; ``versions`` names what makes a
    measurement stale and picks the file. ``seeds`` are JSON files of the same format shipped by a
    plugin, read in order (a later seed wins a key over an earlier one); a missing seed file is
    skipped silently, since a plugin may ship seeds for some device models only.
    """

    def __init__(
        self,
        device: str,
        versions: Mapping[str, str],
        directory: Optional[Path] = None,
        seeds: Sequence[Path] = (),
    ) -> None:
        if not isinstance(device, str) or not _DEVICE_SLUG.fullmatch(device):
            raise ValueError(
                f"tuning cache device {device!r} is not a slug: use letters, digits, '.', '_' and "
                "'-' only, starting with a letter or digit (it names a file), e.g. 'nvidia-h200-sm90'"
            )
        if not isinstance(versions, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items()):
            raise TypeError(f"hal tuning cache versions must be a mapping of names to version strings, e.g. "
                            f"{{'hal': '0.1.0', 'torch': '2.11.0'}}; got {versions!r}")
        self.device = device
        self.versions = dict(versions)
        self.path = Path(directory if directory is not None else cache_dir()) / (
            f"{device}-{_digest(self.versions)}.json"
        )
        self._lock = threading.Lock()  # guards the three dicts below
        self._seeds = self._read_seeds(seeds)
        #: what the file held when last read, overridden by what this process measured
        self._stored = self._read_file(quarantine=False)
        #: what this process measured: it wins over the file at every merge
        self._mine: dict[str, Record] = {}

    def get(self, key: str) -> Optional[Record]:
        """The record for ``key`` (measured here or on this machine, else a seed's), or None.

        A dict lookup: the file is not read. The record is the cache's own; do not modify it."""
        with self._lock:
            record = self._stored.get(key)
            return record if record is not None else self._seeds.get(key)

    def put(self, key: str, record: Record) -> None:
        """Keep ``record`` for ``key`` in memory and merge it into the file.

        Raises TypeError if ``record`` is not a JSON-able dict whose fields hold what
        :data:`FIELDS` says (a caller's bug); problems with the file or its directory are only
        warned about, since the record stays usable in memory."""
        kept = _frozen(key, record)
        with self._lock:
            self._mine[key] = kept
            self._stored[key] = kept
        try:
            self._merge_into_file()
        except OSError as error:
            _warn_once(
                "unwritable",
                self.path,
                f"hal cannot write the tuning cache {self.path} ({error}); measurements are kept in "
                "memory for this process only and will be taken again by the next one. Make "
                f"{self.path.parent} a writable directory, or set HAL_TUNE_CACHE to one.",
            )

    def entries(self) -> dict[str, Record]:
        """Everything known, as a new dict: seeds, overridden by the file and this process."""
        with self._lock:
            return {**self._seeds, **self._stored}

    def export(self, path: Path) -> None:
        """Write the records measured on this machine (``"source": "measured"``, from the file and
        this process) to ``path`` as a seed file, for a plugin to ship. Raises OSError if ``path``
        cannot be written: unlike :meth:`put`, exporting is something the user asked for."""
        with self._lock:
            measured = {k: r for k, r in self._stored.items() if r.get("source") == "measured"}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, self._document(measured))

    def _merge_into_file(self) -> None:
        """Under the file lock: re-read the file, lay this process's records over it, write it back
        and make the merge what this cache serves (it now includes other processes' records)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(self.path.with_name(self.path.name + ".lock")):
            on_disk = self._read_file(quarantine=True)
            with self._lock:
                self._stored = {**on_disk, **self._mine}
                text = self._document(self._stored)
            _write_atomically(self.path, text)

    def _read_file(self, quarantine: bool) -> dict[str, Record]:
        """The entries of this cache's file; none if it is missing or unusable. An unusable file
        is warned about and, with ``quarantine`` (only under the file lock, about to rewrite it),
        moved to ``<file>.corrupt`` so that the rewrite loses nothing."""
        try:
            entries, dropped = _read_entries(self.path, self.device, self.versions)
        except _Unusable as problem:
            corrupt = self.path.with_name(self.path.name + ".corrupt")
            _warn_once(
                "unusable",
                self.path,
                f"hal tuning cache {self.path} is unusable ({problem}); it is ignored and will be "
                f"rewritten by the next measurement, the old file kept as {corrupt}. Nothing needs "
                "doing: kernel choices are measured again.",
            )
            if quarantine:
                os.replace(self.path, corrupt)
            return {}
        if dropped:
            _warn_once(
                "records",
                self.path,
                f"hal tuning cache {self.path}: {_listed(dropped)}; ignored, so those calls are "
                "measured again, and the next measurement rewrites the file without them. Nothing "
                "needs doing.",
            )
        return entries

    def _read_seeds(self, seeds: Sequence[Path]) -> dict[str, Record]:
        """The records of the seed files for this device, each marked ``"source": "seed"``."""
        records: dict[str, Record] = {}
        for seed in map(Path, seeds):
            try:
                entries, dropped = _read_entries(seed, self.device, versions=None)
            except _Unusable as problem:
                _warn_once(
                    "seed",
                    seed,
                    f"hal ignores the tuning seed file {seed} ({problem}); the choices it holds "
                    "will be measured on this machine instead. Ship seeds measured on this device "
                    "model, or remove the file.",
                )
                continue
            if dropped:
                _warn_once(
                    "seed records",
                    seed,
                    f"hal tuning seed file {seed}: {_listed(dropped)}; ignored, the choices they "
                    "held will be measured on this machine. Export seeds with 'hal tune --export' "
                    "rather than editing them by hand.",
                )
            records.update({key: {**record, "source": "seed"} for key, record in entries.items()})
        return records

    def _document(self, entries: Mapping[str, Record]) -> str:
        """The JSON text of a cache or seed file of this device and versions holding ``entries``
        (keys sorted, so that a shipped seed file diffs well)."""
        document = {"format": FORMAT, "device": self.device, "versions": self.versions, "entries": entries}
        return json.dumps(document, indent=1, sort_keys=True) + "\n"


def _digest(versions: Mapping[str, str]) -> str:
    """A short digest of ``versions``, the same in every process and for every order of items."""
    text = json.dumps(sorted(versions.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _frozen(key: str, record: Record) -> Record:
    """A private copy of ``record`` exactly as the file will give it back (through JSON), so that
    this process serves what a restarted one would, and the caller's later changes do not leak in."""
    if not isinstance(key, str):
        raise TypeError(f"tuning cache keys are strings, got {type(key).__name__} {key!r}")
    if not isinstance(record, dict):
        raise TypeError(f"tuning record for {key!r} must be a dict, got {type(record).__name__}")
    try:
        kept = json.loads(json.dumps(record))
    except (TypeError, ValueError) as error:
        raise TypeError(f"tuning record for {key!r} is not JSON-able: {error}") from error
    problem = _record_problem(kept)
    if problem is not None:  # what a later load would drop
        raise TypeError(f"tuning record for {key!r}: {problem}")
    return kept


def _read_entries(path: Path, device: str, versions: Optional[Mapping[str, str]]) -> tuple[dict[str, Record], list[str]]:
    """The usable entries of the cache or seed file at ``path`` (none if there is no file), and
    what was wrong with each record left out. Raises _Unusable if the file cannot be read or
    parsed, or is not of ``device`` and (unless None) ``versions``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return {}, []
    except (OSError, UnicodeDecodeError) as error:
        raise _Unusable(f"cannot read it: {error}") from error
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise _Unusable(f"not valid JSON: {error}") from error
    except RecursionError as error:  # arrays or objects nested deeper than the parser's recursion limit
        raise _Unusable(f"not a tuning cache: JSON nested too deeply to read ({error})") from error
    return _checked_entries(document, device, versions)


def _checked_entries(document: Any, device: str, versions: Optional[Mapping[str, str]]) -> tuple[dict[str, Record], list[str]]:
    """The usable entries of a parsed file, after checking its structure, format, device and
    versions, and each record's fields; with what was wrong with each record left out."""
    if not isinstance(document, dict) or not isinstance(document.get("entries"), dict):
        raise _Unusable("not a tuning cache: expected an object with format, device, versions and entries")
    if document.get("format") != FORMAT:
        raise _Unusable(f"format {document.get('format')!r}, this hal reads format {FORMAT}")
    if document.get("device") != device:
        raise _Unusable(f"measured on device {document.get('device')!r}, not {device!r}")
    if versions is not None and document.get("versions") != dict(versions):
        raise _Unusable(f"measured with versions {document.get('versions')!r}, not {dict(versions)!r}")
    entries: dict[str, Record] = {}
    dropped: list[str] = []
    for key, record in document["entries"].items():
        problem = _record_problem(record)
        if problem is None:
            entries[key] = record
        else:
            dropped.append(f"record {key!r}: {problem}")
    return entries, dropped


def _listed(dropped: Sequence[str], shown: int = 3) -> str:
    """The records left out, for a warning: the first few, then how many more."""
    more = f"; and {len(dropped) - shown} more" if len(dropped) > shown else ""
    return f"{len(dropped)} unusable record(s) ({'; '.join(dropped[:shown])}{more})"


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path`` (created if missing) for the ``with`` block. The
    lock belongs to this open file, so threads of one process exclude each other too."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: written beside it, then renamed over it, so a
    reader sees the old file or the new one, never a part. Not fsynced: a file torn by a power cut
    reads as unusable and is set aside and rewritten, and it is only a cache."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _warn_once(kind: str, path: Path, message: str) -> None:
    """Log ``message`` at WARNING on the "hal" logger, unless this process already warned about
    ``kind`` for ``path``: a cache consulted at every new call must not flood the log."""
    with _warned_lock:
        if (kind, path) in _warned:
            return
        _warned.add((kind, path))
    log.warning(message)
