"""Worker processes behind one /metrics port: each writes its values to files, whichever answers serves the sum.

gunicorn and ``uvicorn --workers`` hand each scrape to one worker. With
``PROMETHEUS_MULTIPROC_DIR`` set (prometheus-client's own setting for this),
every process writes its lock metrics into memory-mapped files of its own
pid, prometheus-client's `MmapedDict` format, in the ``otel_lock``
subdirectory (its own files: prometheus-client's values of the app never
share one with ours). A scrape reads them all with
`MultiProcessCollector.merge`, as prometheus-client's multiprocess mode does:

- counters and histograms are written through at each record (under the
  child's lock, so a file never holds a smaller value than before) and
  summed over every file, those of exited workers included: the sum never
  goes backwards while the directory lives;
- gauges are sampled by a thread of each process every `INTERVAL` seconds
  (and by the answering one at each scrape), in a mode chosen per gauge
  (`GAUGE_MODES`); a process removes its own at its normal exit, and a
  scrape those of any pid no longer alive (no ``child_exit`` hook needed);
- ``target_info`` is one series per live process that has a lock manager,
  with its ``service_instance_id`` and ``pid``;
- the SDK's families (the HTTP instrumentation's) are copied from this
  process's own registry with the gauges: counters and histograms summed,
  ``http_server_active_requests`` as ``livesum``.

A pid reused by a new worker finds the old worker's counter files renamed
aside (still summed), never overwritten.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
import struct
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .._fork import watch_fork
from . import _counts
from ._bounds import Limits
from ._names import OBSERVED, Spec, prom_label, prom_value

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from ._prom import FastMetrics

log = logging.getLogger("otel_lock.telemetry")

SUBDIR = "otel_lock"
# How each process's gauge is combined, as prometheus-client's `multiprocess_mode`:
# counts add up over live workers; the hold age and its lease stay per process
# (a `pid` label) so `hold_age / lease` pairs the same hold; each worker has its
# own circuit breaker, and open (1) is not the numeric max of the states.
GAUGE_MODES = {
    "active": "livesum", "pending": "livesum", "connections": "livesum", "connection_pending": "livesum",
    "hold_age": "liveall", "lease": "liveall", "circuit_state": "liveall",
    "server_verdict": "livemax",  # the worst verdict any live worker holds on a server
    "permits_used": "livesum", "permits_limit": "livemax",  # permits held add up; the limit is one per key
}
# Only while a hold lasts: a sample of 0 (the hold ended) is left out, as one process leaves it out.
_WHILE_HELD = {OBSERVED["hold_age"].prom, OBSERVED["lease"].prom}
INTERVAL = 1.0  # seconds between two gauge samples of one process


def directory() -> str | None:
    """otel-lock's subdirectory of ``PROMETHEUS_MULTIPROC_DIR`` (created), or None when it is not set."""
    base = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not base:
        return None
    if not os.path.isdir(base):
        raise ValueError(f"PROMETHEUS_MULTIPROC_DIR={base!r} is not a directory: create it, empty, before the "
                         "server starts its workers (prometheus-client's multiprocess mode)")
    path = os.path.join(base, SUBDIR)
    os.makedirs(path, exist_ok=True)
    return path


class Files:
    """This process's files in `path`, one per kind (counter, histogram, gauge_<mode>), opened on first use."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pid = os.getpid()
        self._open: dict[str, MmapedDict] = {}
        self._lock = threading.Lock()  # opening a file and adding a key (which may grow the map)
        # Closed once unused (a forked child's copy of its parent's, a retired setup's); never at exit,
        # where a last record (a lock released on the way out) may still write.
        weakref.finalize(self, _close, self._open).atexit = False

    def bind(self, kind: str, keys: Iterable[str]) -> MmapedDict:
        """The file of `kind` with `keys` added, so that a write is a bare store (no growth)."""
        with self._lock:
            file = self._open.get(kind)
            if file is None:
                file = self._open[kind] = MmapedDict(self._fresh(kind))
            for key in keys:
                file.read_value(key)  # adds the key at 0 if new
            return file

    def _fresh(self, kind: str) -> str:
        # Emptied under this live process (a newer start's `rm -rf DIR && mkdir -p DIR`): write in a new one,
        # the lock must not fail over its metrics.
        os.makedirs(self.path, exist_ok=True)
        name = os.path.join(self.path, f"{kind}_{self.pid}.db")
        if os.path.exists(name):  # a dead process had this pid (or an earlier setup() of this one)
            if kind.startswith("gauge_live"):
                _remove(name)  # its live gauges died with it
            else:
                os.replace(name, os.path.join(self.path, f"{kind}_{self.pid}-{uuid.uuid4().hex[:8]}.db"))
        return name


def _close(files: dict[str, MmapedDict]) -> None:
    for file in files.values():
        file.close()


class SharedCounter:
    """A counter child's place in the file: its total, written through."""

    __slots__ = ("file", "key")

    def __init__(self, files: Files, spec: Spec, labels: Mapping[str, str]) -> None:
        self.key = mmap_key(spec.prom, spec.prom + "_total", list(labels), list(labels.values()), spec.description)
        self.file = files.bind("counter", [self.key])

    def write(self, index: int, count: int, total: float) -> None:
        self.file.write_value(self.key, total, 0.0)


class SharedHistogram:
    """A histogram child's place: one count per bucket (not cumulative, as prometheus-client stores them), the sum."""

    __slots__ = ("file", "buckets", "sum")

    def __init__(self, files: Files, spec: Spec, labels: Mapping[str, str]) -> None:
        names, values = list(labels), list(labels.values())
        self.buckets = [mmap_key(spec.prom, spec.prom + "_bucket", names + ["le"], values + [floatToGoString(b)],
                                 spec.description) for b in (*spec.buckets, float("inf"))]
        self.sum = mmap_key(spec.prom, spec.prom + "_sum", names, values, spec.description)
        self.file = files.bind("histogram", [*self.buckets, self.sum])

    def write(self, index: int, count: int, total: float) -> None:
        self.file.write_value(self.buckets[index], count, 0.0)
        self.file.write_value(self.sum, total, 0.0)


def shared(files: Files, spec: Spec, labels: Mapping[str, str]) -> SharedCounter | SharedHistogram:
    return SharedHistogram(files, spec, labels) if spec.kind == "histogram" else SharedCounter(files, spec, labels)


class Publisher:
    """Writes this process's gauges (and target_info) to its files: every `INTERVAL` on a thread, and on demand."""

    def __init__(self, fast: FastMetrics | None, files: Callable[[], Files | None],
                 target: Callable[[], Mapping[str, Any]], sdk: CollectorRegistry | None = None) -> None:
        self._fast = fast  # None: /metrics is off, only target_info is published
        self._sdk = sdk  # the SDK's Prometheus reader, on a registry of this process only
        self._files = files
        self._target = target
        self._limits = {which: Limits(spec.name, spec.labels) for which, spec in OBSERVED.items()}
        self._written: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._start()
        watch_fork(self._forked)
        atexit.register(_exited, files)

    def _forked(self) -> None:
        # The child's own files, lock and thread (the parent's thread is not in the child).
        self._written, self._lock = {}, threading.Lock()
        self._start()

    def _start(self) -> None:
        # The thread publishes first: in a forked child every fork hook (a new instance id) has run by then.
        threading.Thread(target=_run, args=(weakref.ref(self),), name="otel-lock gauge files", daemon=True).start()

    def writable(self) -> bool:
        """False once the directory is gone (emptied for a new run): this thread has nothing left to do."""
        files = self._files()
        return files is not None and os.path.isdir(files.path)

    def publish(self) -> None:
        files = self._files()
        if files is None:
            return
        from ._instruments import routed

        counts = [c for c in list(_counts.ALL_COUNTS) if routed(c.meter_provider)]
        with self._lock:
            # Only a process with a lock manager pushes lock metrics: a gunicorn master without one
            # would otherwise be a replica whose metrics never arrive (OtelLockReplicaMetricsMissing).
            if counts:  # liveall: the collector adds each process's `pid` label
                labels = {prom_label(str(k)): prom_value(v) for k, v in sorted(self._target().items())}
                key = mmap_key("target_info", "target_info", list(labels), list(labels.values()), "Target metadata")
                files.bind("gauge_liveall", [key]).write_value(key, 1.0, 0.0)
            if self._fast is not None:
                self._gauges(files, counts)
            if self._sdk is not None:
                for family in self._sdk.collect():
                    _copy(files, family)

    def _gauges(self, files: Files, counts: list[_counts.LockCounts]) -> None:
        for which, spec in OBSERVED.items():
            names = [prom_label(n) for n in spec.labels]
            points = {mmap_key(spec.prom, spec.prom, names, [str(attributes.get(n, "")) for n in spec.labels],
                               spec.description): value
                      for attributes, value in _counts.observe(which, counts, self._limits[which])}
            # A series seen before and not now (the hold ended, the name went) is written 0, not left stale.
            gone = self._written.get(which, set()) - points.keys()
            file = files.bind(f"gauge_{GAUGE_MODES[which]}", [*points, *gone])
            for key, value in points.items():
                file.write_value(key, value, 0.0)
            for key in gone:
                file.write_value(key, 0.0, 0.0)
            self._written[which] = set(points)


def _copy(files: Files, family: Metric) -> None:
    """One family of this process's SDK reader into its files (cumulative values: they only grow)."""
    kind = {"counter": "counter", "histogram": "histogram", "gauge": "gauge_livesum"}.get(family.type)
    if kind is None:
        return
    points: dict[str, float] = {}
    below: dict[tuple[tuple[str, str], ...], float] = {}  # cumulative count of the previous bucket
    for sample in family.samples:
        if sample.name.endswith(("_created", "_count")) and family.type != "gauge":
            continue  # the merge derives _count from the buckets; _created has no meaning summed
        labels = dict(sample.labels)
        value = sample.value
        if sample.name.endswith("_bucket"):  # stored per bucket, as prometheus-client does
            series = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            value, below[series] = value - below.get(series, 0.0), value
        points[mmap_key(family.name, sample.name, list(labels), list(labels.values()), family.documentation)] = value
    file = files.bind(kind, points)
    for key, value in points.items():
        file.write_value(key, value, 0.0)


def _run(ref: weakref.ref[Publisher]) -> None:
    while True:
        publisher = ref()
        if publisher is None or not publisher.writable():
            return
        try:
            publisher.publish()
        except Exception:  # a sample must never end the thread
            log.exception("otel-lock: writing the gauge files failed")
        del publisher  # the thread must not keep it alive
        time.sleep(INTERVAL)  # a sampling period, not a wait for anything


def _exited(files: Callable[[], Files | None]) -> None:
    """At this process's exit: its live gauges go (counters stay, as prometheus-client keeps them)."""
    current = files()
    if current is not None and current.pid == os.getpid():
        mark_process_dead(current.pid, current.path)


class SharedCollector(Collector):
    """/metrics of every process: the files merged, dead processes' live gauges dropped first."""

    def __init__(self, path: str, publisher: Publisher, fast: FastMetrics | None) -> None:
        self._path = path
        self._publisher = publisher
        self._fast = fast

    def collect(self) -> Iterable[Metric]:
        self._publisher.publish()  # the answering process's gauges as of now
        sweep(self._path)
        merged = _merged(self._path)
        for metric in merged:
            if metric.name in _WHILE_HELD:
                metric.samples = [s for s in metric.samples if s.value != 0]
            elif self._fast is not None and metric.type == "histogram":
                self._fast.add_exemplars(metric)
        return merged

    def describe(self) -> Iterable[Metric]:
        return []  # families appear with the files; nothing to check against other collectors


def _merged(path: str) -> list[Metric]:
    """The files summed, read while other workers write them.

    A worker creates a file empty and sizes it a moment later (prometheus-client's
    `MmapedDict`): read in that moment it has no header. Such a file holds no value yet
    and is left out; a file renamed aside (a reused pid) or dropped (a dead process's
    gauges) between the listing and the read sends the scrape round once more.
    """
    for _ in range(2):
        try:
            return list(MultiProcessCollector.merge(_started(path)))
        except (FileNotFoundError, struct.error):
            continue  # a file changed between the listing and the read: list them again
    return list(MultiProcessCollector.merge(_started(path)))


def _started(path: str) -> list[str]:
    """The files in `path` that have their header (how much of the file is used) written."""
    files = []
    for name in glob.glob(os.path.join(path, "*.db")):
        with contextlib.suppress(FileNotFoundError):
            if os.path.getsize(name) >= 8:
                files.append(name)
    return files


def sweep(path: str) -> None:
    """Remove the live gauges of processes that are gone (gunicorn's ``child_exit`` may not be configured).

    Every worker sweeps at each scrape it answers, so two may remove the same file at once. A
    uvicorn worker stopped by SIGTERM ends by that signal, without exit hooks: each such exit
    leaves its files to the sweep.
    """
    for name in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        pid = os.path.basename(name).rsplit("_", 1)[-1][:-3]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(name)


def _remove(name: str) -> None:
    # Not mark_process_dead: it raises when another process removed the file first (a scrape answered 500).
    with contextlib.suppress(FileNotFoundError):
        os.remove(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def serve(registry: CollectorRegistry, path: str, fast: FastMetrics | None,
          target: Callable[[], Mapping[str, Any]], sdk: CollectorRegistry | None = None) -> Publisher:
    """Put the merged files on `registry`; `fast` (None: /metrics off) writes its instruments there.

    `sdk`: this process's registry of the SDK's Prometheus reader, copied to the files.
    """
    files = fast.files if fast is not None else _OwnFiles(path)
    publisher = Publisher(fast, files, target, sdk)
    registry.register(SharedCollector(path, publisher, fast))
    return publisher


class _OwnFiles:
    """Files of this process for target_info alone (no fast path on /metrics): renewed in a forked child."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._files = Files(path)

    def __call__(self) -> Files:
        if self._files.pid != os.getpid():
            self._files = Files(self._path)
        return self._files
