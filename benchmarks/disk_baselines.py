"""What the disk under a folder offers, measured three ways; a tier is compared with the best.

1. ``preadv``/``pwritev`` threads: sequential O_DIRECT requests of ``block`` bytes,
   ``threads`` in flight (the standard library, as the tier itself does I/O).
2. fio with libaio, and 3. fio with io_uring, at ``iodepth`` requests in flight: the
   asynchronous engines a C program would use, so a baseline that a thread pool does not
   understate. fio is a system package (``apt-get install fio``); without it the
   benchmark says so and keeps the first baseline.

Each returns (write, read) in bytes/s of a new file of ``nbytes``, deleted afterwards.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class Baseline:
    engine: str
    write: float
    read: float
    direct: bool = True

    def describe(self) -> str:
        return (
            f"{self.engine}{'' if self.direct else ' (buffered)'}: write {self.write / 1e9:.2f} GB/s, "
            f"read {self.read / 1e9:.2f} GB/s"
        )


def thread_bandwidth(directory: str, nbytes: int, block: int, threads: int) -> Baseline:
    """Sequential requests from a thread pool, O_DIRECT where the filesystem takes it."""
    path = os.path.join(directory, "raw-bandwidth.bin")
    buffer = mmap.mmap(-1, block)
    buffer.write(os.urandom(block))
    view = memoryview(buffer)
    offsets = range(0, nbytes, block)
    direct = True
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        direct = False
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            list(pool.map(lambda offset: os.pwritev(fd, [view], offset), offsets))
            os.fsync(fd)
            write = nbytes / (time.perf_counter() - started)
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        reads = [mmap.mmap(-1, block) for _ in range(threads)]
        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            list(pool.map(lambda i: os.preadv(fd, [reads[i % threads]], offsets[i]), range(len(offsets))))
            read = nbytes / (time.perf_counter() - started)
    finally:
        os.close(fd)
        os.unlink(path)
    return Baseline(f"preadv/pwritev, {threads} threads", write, read, direct)


def fio_bandwidth(directory: str, nbytes: int, block: int, engine: str, depth: int) -> Baseline | None:
    """fio's sequential write then read with ``engine`` at ``depth``; None without fio or
    where the engine is unavailable (io_uring is often disabled in containers)."""
    if shutil.which("fio") is None:
        return None
    path = os.path.join(directory, "fio-bandwidth.bin")
    rates = {}
    try:
        for mode in ("write", "read"):
            command = [
                "fio", "--name=baseline", f"--filename={path}", f"--size={nbytes}", f"--bs={block}",
                f"--iodepth={depth}", f"--ioengine={engine}", f"--rw={mode}", "--direct=1",
                "--end_fsync=1", "--output-format=json",
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return None
            job = json.loads(done.stdout)["jobs"][0]
            rates[mode] = float(job[mode]["bw_bytes"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return Baseline(f"fio {engine}, iodepth {depth}", rates["write"], rates["read"])


def best(baselines: list[Baseline]) -> Baseline:
    """The strongest baseline per direction: the tier is held to the fastest engine."""
    write = max(baselines, key=lambda b: b.write)
    read = max(baselines, key=lambda b: b.read)
    return Baseline(f"best (write: {write.engine}; read: {read.engine})", write.write, read.read)
