"""A barrier for processes on one host, through POSIX semaphores in shared memory.

The shared-memory collectives (:mod:`cargohold.services.worker.colocated_collectives`) need one
barrier per collective. Gloo's costs ~0.5 ms and ~0.3 CPU-ms a rank on loopback TCP (its
own threads, a message each way, wake-ups through its event loop); a futex-backed
semaphore in memory both processes map costs ~12 us and ~6 CPU-us (2 ranks, measured on
the 2-core development VM).

Each rank's shared region starts with its *inbox*: one process-shared semaphore
(``sem_init(pshared=1)``) per rank of the group. To pass the barrier, rank r posts to its
slot in every peer's inbox, then waits once on each peer's slot in its own. A semaphore
per (receiver, sender) pair counts that sender's arrivals, so a peer that has already
passed and reaches the next barrier cannot stand in for one that has not arrived yet.
``sem_post`` and ``sem_wait`` are full memory barriers: what a rank wrote before it
posted is visible to the peer that waited for the post.

A peer that dies would leave the others waiting forever: the wait wakes every
:data:`POLL_S` to look whether each awaited peer still runs, and raises
:class:`~cargohold.services.core.errors.TrainingError` naming it when it does not (or after
:data:`TIMEOUT_S`, as a gloo group's default timeout would).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import time
from pathlib import Path

from cargohold.services.core.errors import TrainingError

SEMAPHORE_BYTES = 64
"""Room for one ``sem_t`` (32 bytes on Linux), one cache line each."""
POLL_S = 1.0
"""How often a waiting rank looks whether the peers it waits for still run."""
TIMEOUT_S = 1800.0
"""The longest a rank waits for a live peer: a gloo process group's default timeout."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _libc() -> ctypes.CDLL:
    """The process's own C library, its semaphore calls typed; OSError where it has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
        for name in ("sem_post", "sem_trywait"):
            getattr(libc, name).argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError) as error:
        raise OSError(errno.ENOSYS, f"no process-shared semaphores in this C library: {error}") from error
    return libc


def inbox_nbytes(world_size: int) -> int:
    """Bytes of a rank's inbox at the start of its region: whole pages."""
    return -(-world_size * SEMAPHORE_BYTES // 4096) * 4096


def init_inbox(address: int, world_size: int) -> None:
    """Make the semaphores of the inbox at ``address`` (in memory other processes map),
    each at zero; OSError where the C library refuses."""
    libc = _libc()
    for k in range(world_size):
        if libc.sem_init(address + k * SEMAPHORE_BYTES, 1, 0) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"sem_init of a process-shared semaphore: {errno.errorcode.get(error, error)}")


class SharedBarrier:
    """Rank ``rank`` of the processes ``pids`` (one per rank) whose inboxes are at
    ``inboxes`` in this process's address space; see the module's doc."""

    def __init__(self, rank: int, inboxes: list[int], pids: list[int]) -> None:
        self.rank = rank
        self.pids = pids
        self._libc = _libc()
        self._peers = [k for k in range(len(inboxes)) if k != rank]
        self._outgoing = [inboxes[k] + rank * SEMAPHORE_BYTES for k in self._peers]
        self._incoming = [inboxes[rank] + k * SEMAPHORE_BYTES for k in self._peers]

    def wait(self) -> None:
        """Return once every rank has called it as many times as this one."""
        for semaphore in self._outgoing:
            if self._libc.sem_post(semaphore) != 0:
                raise OSError(ctypes.get_errno(), "sem_post")
        for peer, semaphore in zip(self._peers, self._incoming):
            if self._libc.sem_trywait(semaphore) != 0:
                self._wait_for(peer, semaphore)

    def _wait_for(self, peer: int, semaphore: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            wake = time.time() + POLL_S
            when = _Timespec(int(wake), int((wake % 1) * 1e9))
            if self._libc.sem_timedwait(semaphore, ctypes.byref(when)) == 0:
                return
            error = ctypes.get_errno()
            if error == errno.EINTR:
                continue
            if error != errno.ETIMEDOUT:
                raise OSError(error, f"sem_timedwait: {errno.errorcode.get(error, error)}")
            if not _running(self.pids[peer]):
                raise TrainingError(
                    f"rank {peer} (pid {self.pids[peer]}) exited while rank {self.rank} waited for it in a collective"
                )
            if time.monotonic() > deadline:
                raise TrainingError(f"rank {self.rank} waited {TIMEOUT_S:.0f} s for rank {peer} in a collective")


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
