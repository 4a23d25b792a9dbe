"""`make gpu-check`: the GPU checks of cargohold in one run of at most 6 minutes.

    python benchmarks/gpu_check.py            # from the repository root, on a machine with CUDA

First, the versions: Python, torch (the image's, which may differ from the one cargohold
pins: the install is ``--no-deps``), cargohold and any other requirement that differs from
its pin; then a check that the cargohold imported is this tree's (``make gpu-check``
builds it from the tree in the same command): a stale install stops the run. Then:

1. the correctness contract on CUDA with NCCL (tests/test_gpu_contract.py) and the other
   tests marked ``gpu``, by file (a test file importing a package the GPU machine lacks
   cannot stop collection): bitwise against torch's fused AdamW;
2. host-device copy bandwidth through cargohold's page-locked shared exchange buffers
   against plain pinned memory (benchmarks/pinned_copy.py);
3. benchmarks/end_to_end.py on examples/gpu-check.yaml (bf16 gradients:
   ``tuning.worker.grad_wire_dtype``), only when the tests passed: the
   offloaded step against the same model trained all on the GPU with AdamW (goal: step
   ratio <= 1.15).

Each part runs with its own time limit, cut to what is left of :data:`BUDGET_S`; a part
that fails or runs out of time is reported and the next one runs. The last lines are one
line per figure.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_MARK = "pytest.mark.gpu"
BUDGET_S = 330
"""The parts together; with the install (~20 s) one ``make gpu-check`` stays under 6 minutes,
so that a 15-minute lease holds the machine's start, a run and a second run."""
FIGURE = re.compile(r"^(RATIO .*|\d+ (passed|skipped).*|.*\d+ failed.*|d2h .*|h2d .*)$")


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    command: list[str]
    limit_s: int
    after_tests: bool = False
    """Runs only when the gpu tests passed (some ran, none failed)."""


def gpu_test_files(tests: Path = ROOT / "tests") -> list[str]:
    """The test files that hold tests marked ``gpu``, relative to the repository root."""
    return sorted(str(path.relative_to(ROOT)) for path in tests.glob("test_*.py") if GPU_MARK in path.read_text())


def parts() -> list[Part]:
    python = sys.executable
    return [
        Part("gpu tests", [python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *gpu_test_files()],
             150),
        Part("pinned copies", [python, "benchmarks/pinned_copy.py"], 30),
        Part(
            "end to end",
            # bf16 gradients, as examples/gpu-check.yaml set them before the wire dtype became a
            # tuning value (which no shipped example sets).
            [python, "benchmarks/end_to_end.py", "--config", "examples/gpu-check.yaml", "--variants", "zero3+ac",
             "--steps", "5", "--warmup", "2", "--set", "tuning.worker.grad_wire_dtype=bfloat16"],
            150,
            after_tests=True,
        ),
    ]  # fmt: skip


def versions() -> list[str]:
    """Python's, torch's (with its CUDA and device) and cargohold's versions, and a line for
    each of cargohold's requirements whose installed version is not the pinned one."""
    import torch

    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no CUDA"
    lines = [
        f"python {platform.python_version()} ({sys.executable})",
        f"torch {torch.__version__} ({cuda}) from {Path(torch.__file__).parent}",
        f"cargohold {importlib.metadata.version('cargohold')} from {_installed_folder('cargohold')}",
    ]
    for requirement in importlib.metadata.requires("cargohold") or []:
        if "extra ==" in requirement or "==" not in requirement:
            continue
        name, _, pinned = requirement.partition("==")
        name, pinned = name.split("[")[0].strip(), pinned.split(";")[0].strip()
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "missing"
        if have.split("+")[0] != pinned:
            lines.append(f"NOTE {name} {have} here; cargohold pins {pinned}")
    return lines


def _installed_folder(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{package} is not importable: run make gpu-check (it installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def stale_files(locate: Callable[[str], Path] = _installed_folder, root: Path = ROOT) -> list[str]:
    """Source files of the imported cargohold that are not the tree's (pyproject's
    package-dir maps each package to its folder), as ``tree path`` strings."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setup["package-dir"]
    stale = []
    for package in setup["packages"]:
        base = max((name for name in mapped if package == name or package.startswith(name + ".")), key=len)
        folder = root / mapped[base] / package[len(base) :].lstrip(".").replace(".", "/")
        installed = locate(package)
        for source in sorted(folder.glob("*.py")):
            copy = installed / source.name
            if not copy.is_file() or copy.read_bytes() != source.read_bytes():
                stale.append(str(source.relative_to(root)))
    return stale


def run_parts(selected: Sequence[Part], budget_s: float) -> tuple[list[str], bool]:
    """Run each part within its limit and what is left of ``budget_s``; the figures, and
    whether every part succeeded."""
    deadline = time.monotonic() + budget_s
    figures: list[str] = []
    failed = tests_failed = False
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for part in selected:
        if part.after_tests and tests_failed:
            figures.append(f"{part.name}: skipped (no gpu test passed, or one failed)")
            continue
        limit = max(1, min(part.limit_s, int(deadline - time.monotonic())))
        print(f"=== {part.name}: {' '.join(part.command[1:])} (limit {limit} s)", flush=True)
        try:
            done = subprocess.run(part.command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            output, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as expired:
            output = "".join(_text(stream) for stream in (expired.stdout, expired.stderr))
            code = None
        print(output, flush=True)
        lines = [line.strip() for line in output.splitlines() if FIGURE.match(line.strip())]
        status = "timed out" if code is None else ("ok" if code == 0 else f"exit {code}")
        failed |= code != 0
        # all skipped (torch sees no CUDA) is no pass: the end to end part would only wait
        tests_failed |= part.name == "gpu tests" and (code != 0 or not re.search(r"\b\d+ passed", output))
        figures += [f"{part.name}: {line}" for line in lines] or [f"{part.name}: no figure ({status})"]
        if code != 0:
            figures.append(f"{part.name}: {status}")
    return figures, not failed and not tests_failed


def _text(stream: bytes | str | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def main() -> int:
    started = time.monotonic()
    for line in versions():
        print(line, flush=True)
    if stale := stale_files():
        print(
            f"the cargohold imported ({_installed_folder('cargohold')}) is not this tree's: {', '.join(stale)} "
            "differ; run make gpu-check, which builds and installs it from the tree"
        )
        return 2
    print("cargohold's installed sources equal the tree's", flush=True)
    figures, passed = run_parts(parts(), BUDGET_S)
    print(f"=== figures ({time.monotonic() - started:.0f} s in all)")
    for line in figures:
        print(line)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
