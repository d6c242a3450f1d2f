"""The machine's cores, split between CPU engines' model threads and everything else.

A CPU engine whose model runs on fewer threads than the machine has cores shares them with the
host processes: its inferlets' sandboxes, their host actors, pie serve. Left to the kernel's
scheduler, on 2 cores with a 1-thread engine under pie serve on the cluster, the model thread was
switched out 3,400 times in 12 s, queued behind the others' bursts 9% of the time and ran ~14%
slower on the caches they cooled ("pie serve on the cluster" in bench/RESULTS.md).
So, as vLLM's CPU backend binds its OpenMP threads to cores of their own, an engine in a process
of its own reserves `num_threads` cores (the highest free ones, always leaving one for the rest),
pins its model thread there (the OpenMP threads it starts inherit the pin) and moves its process's
other threads off them; the runtime's process and the inferlet host actors keep off every
reserved core (`keep_off`, at each launch and close).

An engine reserves its cores from its model thread (`ModelCores.hold`), and tries again every few
seconds while none are free: the process of an engine that is ending, or of a cluster that is
shutting down, may still hold them.

Reservations are the machine's, not a Ray node's: several Ray nodes may share one machine
(`ray.cluster_utils.Cluster`), and cores are the machine's. They live in a small JSON file in the
temp folder, under an flock; an entry of a process that ended is dropped at the next change.
Where threads cannot be pinned (not Linux), nothing is reserved and nothing moves.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from .config import EngineConfig

SUPPORTED = hasattr(os, "sched_setaffinity")
ENV = "PIE_CORES"
REGISTRY = Path(tempfile.gettempdir()) / f"pie_actors-cores-{os.getuid()}.json"


def _allowed() -> frozenset[int]:
    """The cores this runtime's processes may use: those the first of them could (its children
    learn them from PIE_CORES, for they inherit whatever mask their parent's thread had then:
    a restarted engine child of a process kept off its engine's core, a Ray node started by it)."""
    if not SUPPORTED:
        return frozenset(range(os.cpu_count() or 1))
    if os.environ.get(ENV):
        return frozenset(int(c) for c in os.environ[ENV].split(","))
    cores = frozenset(os.sched_getaffinity(0))
    os.environ[ENV] = ",".join(map(str, sorted(cores)))
    return cores


ALLOWED = _allowed()
log = logging.getLogger("pie.engine")
# the cores this process's threads run on now (`keep_off`): a child may start narrower than ALLOWED
_kept_off = frozenset(os.sched_getaffinity(0)) if SUPPORTED else ALLOWED


class ModelCores:
    """The cores a model thread runs on. `hold`, called from that thread before each step, reserves
    `count` of them and pins the thread there; while none are free (the process of an engine that is
    ending may still hold them) it tries again every RETRY_S. `count` 0: it never pins."""

    RETRY_S = 5.0

    def __init__(self, count: int = 0) -> None:
        self.count = count if SUPPORTED else 0
        self.cores: frozenset[int] = frozenset()
        self._next_try = 0.0

    @classmethod
    def for_engine(cls, config: EngineConfig, device_type: str) -> ModelCores:
        """An engine's (or tensor-parallel rank's) in a process of its own: `num_threads` cores when
        `pin_cores` is on and it runs on the CPU; none otherwise (its threads run where the
        scheduler puts them)."""
        return cls(config.num_threads if config.pin_cores and device_type == "cpu" else 0)

    def hold(self) -> None:
        if self.cores or not self.count or time.monotonic() < self._next_try:
            return
        self.cores = reserve(self.count)
        if self.cores:
            pin_model_thread(self.cores)
        else:
            self._next_try = time.monotonic() + self.RETRY_S

    def release(self) -> None:
        if self.cores:
            release()
            self.cores = frozenset()


def reserve(count: int) -> frozenset[int]:
    """Reserve `count` cores for this process's model threads: the highest ones no other process
    holds, if one is left over after them (else none). It replaces this process's earlier one."""
    with _entries() as entries:
        taken = {c for pid, cores in entries.items() if pid != os.getpid() for c in cores}
        free = sorted(ALLOWED - taken)
        if count < 1 or len(free) <= count:
            return frozenset()
        mine = frozenset(free[-count:])
        entries[os.getpid()] = sorted(mine)
    log.info("the model's threads run on cores %s; the runtime's processes keep off them", sorted(mine))
    return mine


def release() -> None:
    """Give back this process's reservation (an engine that closes)."""
    with _entries() as entries:
        entries.pop(os.getpid(), None)


def pin_model_thread(cores: frozenset[int]) -> None:
    """Pin the calling thread, the model's, to `cores`, and this process's other threads off them."""
    os.sched_setaffinity(0, cores)          # pid 0: the calling thread alone
    _move_threads((ALLOWED - cores - _reserved_by_others()) or (ALLOWED - cores),
                  skip=threading.get_native_id())


def keep_off() -> None:
    """Move this process's threads off the cores other processes reserved, or back onto every core
    it may use once none are. Cheap when nothing changed: a read of the registry."""
    global _kept_off
    if not SUPPORTED:
        return
    cores = (ALLOWED - _reserved_by_others()) or ALLOWED
    if cores != _kept_off:
        _move_threads(cores)
        _kept_off = cores


def _reserved_by_others() -> frozenset[int]:
    try:
        with open(REGISTRY) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            entries = _parse(f.read())
    except FileNotFoundError:
        return frozenset()
    return frozenset(c for pid, cores in entries.items() if pid != os.getpid() and _alive(pid) for c in cores)


def _move_threads(cores: frozenset[int], skip: int | None = None) -> None:
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != skip:
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:                    # a thread that ended meanwhile
                pass


@contextmanager
def _entries() -> Iterator[dict[int, list[int]]]:
    """The registry's live entries (pid -> cores), locked; what the block leaves in them is written."""
    with open(REGISTRY, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        entries = {pid: cores for pid, cores in _parse(f.read()).items() if _alive(pid)}
        yield entries
        f.seek(0)
        f.truncate()
        json.dump(entries, f)


def _parse(text: str) -> dict[int, list[int]]:
    try:
        return {int(pid): cores for pid, cores in json.loads(text).items()} if text else {}
    except (ValueError, AttributeError):    # a file no one else writes, cut short: start again
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                 # another user's process (a reused pid): alive
        return True
    return True
