"""Peak memory of processes as the kernel counts it: VmHWM and RSS from /proc, a sampler
of every Ray process a run starts (so a peak is attributed to the call that raised it),
and the shared-memory exchange buffers a worker maps."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

SAMPLE_S = 0.05


# --- reading process memory -------------------------------------------------------------
def peak_rss(status: str, field: str = "VmHWM") -> int:
    """VmHWM (or another Vm/Rss field) in bytes from the text of /proc/<pid>/status."""
    line = next(line for line in status.splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def exchange_rss(pid: int) -> int:
    """Resident bytes of the process's mappings of cargohold's shared memory (memfds, ``smaps``)."""
    total, in_shm = 0, False
    for line in (read_text(f"/proc/{pid}/smaps") or "").splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            in_shm = len(fields) >= 6 and fields[5].startswith("/memfd:cargohold-")
        elif in_shm and fields[:1] == ["Rss:"]:
            total += int(fields[1]) * 1024
    return total


@dataclass
class ProcessTrace:
    """What the sampler saw of one process."""

    pid: int
    role: str
    """worker, server or driver."""
    hwm: int = 0
    rss: int = 0
    """VmRSS after the step (:meth:`RayProcessWatch.freeze_rss`)."""
    shared: int = 0
    """The part of ``rss`` that maps shared memory: the workers' exchange buffers,
    counted in the RSS of the worker and of the co-located server alike."""
    peak_during: str = ""
    """The call (method of the actor) running when VmHWM last rose."""
    hwm_after: dict[str, int] = field(default_factory=dict)
    """VmHWM when each call was last seen running: the peak reached up to and during it."""
    last_call: str = "start"
    hwm_at: dict[str, int] = field(default_factory=dict)
    """VmHWM at each moment :meth:`RayProcessWatch.mark` named (e.g. "started": the
    session started, no step run yet)."""


class RayProcessWatch:
    """Samples every descendant of this process whose title names a cargohold actor, so
    per-process peaks are known without calling into the actors (which run one call at a
    time). Titles are Ray's ``ray::<Class>.<method>`` (``ray::<Class>`` when idle)."""

    ROLES = {"TrainingWorker": "worker", "StateServer": "server"}

    def __init__(self, interval: float = SAMPLE_S) -> None:
        self.interval = interval
        self.traces: dict[int, ProcessTrace] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-watch")
        self._known_other: set[int] = set()
        self._frozen = False
        self._lock = threading.Lock()

    def __enter__(self) -> RayProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def freeze_rss(self) -> None:
        """Sample now and keep each process's RSS as it is (after the step, before teardown)."""
        self.sample()
        self._frozen = True

    def mark(self, moment: str) -> None:
        """Sample now and note every process's VmHWM as of ``moment``."""
        with self._lock:
            self._sample()
            for trace in self.traces.values():
                trace.hwm_at[moment] = trace.hwm

    def by_role(self, role: str) -> list[ProcessTrace]:
        return sorted((t for t in self.traces.values() if t.role == role), key=lambda t: t.pid)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        with self._lock:
            self._sample()

    def _sample(self) -> None:
        for pid in self._descendants(os.getpid()):
            if pid in self._known_other:
                continue
            title = (read_text(f"/proc/{pid}/cmdline") or "").split("\0")[0]
            actor = title.removeprefix("ray::").split(".")[0].split(" ")[0] if title.startswith("ray::") else ""
            role = self.ROLES.get(actor)
            if role is None:
                if title and "python" not in title and not title.startswith("ray::"):
                    self._known_other.add(pid)  # raylet, gcs: never an actor (Python workers are renamed later)
                continue
            status = read_text(f"/proc/{pid}/status")
            if status is None or "VmHWM:" not in status:  # gone, or a zombie (no memory left)
                continue
            trace = self.traces.setdefault(pid, ProcessTrace(pid, role))
            # Between calls the title is the bare class: a rise seen then happened at the
            # end of the call seen last (or in what little runs between calls).
            call = title.removeprefix(f"ray::{actor}").lstrip(".").split("(")[0] or trace.last_call
            hwm = peak_rss(status)
            if hwm > trace.hwm:
                trace.peak_during = call
            trace.hwm, trace.last_call = hwm, call
            trace.hwm_after[call] = hwm
            if not self._frozen:
                trace.rss = peak_rss(status, "VmRSS")
                trace.shared = exchange_rss(pid)

    @staticmethod
    def _descendants(root: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            stat = read_text(f"/proc/{entry.name}/stat")
            if stat is None:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [root]
        while todo:
            for child in children.get(todo.pop(), []):
                out.append(child)
                todo.append(child)
        return out


def start_local_ray(num_cpus: int) -> None:
    import ray

    # address="local": never join a cluster someone else started on this machine.
    ray.init(
        address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False
    )
