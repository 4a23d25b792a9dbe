"""`make gpu-check` (benchmarks/gpu_check.py) as far as a machine without a GPU can see it:
its gpu tests collect with only what the GPU machine has (its image and the carried
wheels), the cargohold it runs is the tree's, the parts fit the time budget, and the end
to end part runs only after the tests passed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from reference import tiny_config

from cargohold.cluster.sections import config_task

ROOT = Path(__file__).resolve().parents[1]
MINUTES_6 = 360
INSTALL_S = 30
"""The wheels' install and cargohold's build on the GPU machine, about."""


def _benchmark(name: str) -> ModuleType:
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.append(str(ROOT / "benchmarks"))  # the benchmarks import each other
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _benchmark("gpu_check")
gpu_wheels = _benchmark("gpu_wheels")


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\[=<>;!~ ]", requirement.strip(), maxsplit=1)[0]).lower()


def _absent_on_the_gpu_machine() -> tuple[set[str], set[str]]:
    """cargohold's requirements (test extras included) that neither the GPU image nor the
    carried wheels provide, and the top-level modules that only they install here."""
    present = {_name(n) for n in (*gpu_wheels.GPU_IMAGE, *gpu_wheels.PINS, "cargohold")}
    absent = {_name(r) for r in importlib.metadata.requires("cargohold") or []} - present
    modules = {
        module
        for module, distributions in importlib.metadata.packages_distributions().items()
        if all(_name(d) in absent for d in distributions)
    }
    return absent, modules


BLOCKER = """
import importlib.abc, sys
ABSENT = set(sys.argv[1].split(","))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)", name=name)
        return None
sys.meta_path.insert(0, Absent())
try:
    import promql_parser
except ModuleNotFoundError:
    print("promql_parser blocked")
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def test_the_gpu_tests_collect_with_only_what_the_gpu_machine_has() -> None:
    """The gpu part's own pytest command, collecting only, with every module of a
    requirement the GPU machine lacks made unimportable (test_deploy.py's promql_parser)."""
    absent, modules = _absent_on_the_gpu_machine()
    assert {"promql-parser", "datasets", "grpcio-tools"} <= absent, absent
    command = gpu_check.parts()[0].command
    assert command[1:5] == ["-m", "pytest", "-q", "-m"] and "tests/test_gpu_contract.py" in command
    assert "tests" not in command and "tests/test_deploy.py" not in command
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER, ",".join(sorted(modules)), *command[3:], "--collect-only"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.startswith("promql_parser blocked"), result.stdout[-2000:] + result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "test_a_cuda_worker_matches_torch_adamw_bitwise" in result.stdout
    assert "test_a_refused_registration_does_not_fail_the_next_kernel" in result.stdout


def test_the_installed_cargohold_is_checked_against_the_tree(tmp_path: Path) -> None:
    assert gpu_check.stale_files() == []  # the editable install is the tree
    packages = {}
    for package in ("cargohold", "cargohold.services.worker", "cargohold.cluster"):
        packages[package] = folder = tmp_path / package
        shutil.copytree(gpu_check._installed_folder(package), folder, ignore=shutil.ignore_patterns("__pycache__"))

    def locate(package: str) -> Path:
        return packages.get(package) or gpu_check._installed_folder(package)

    assert gpu_check.stale_files(locate) == []
    step = packages["cargohold.services.worker"] / "step.py"
    step.write_text(step.read_text() + "# built from an older tree\n")
    (packages["cargohold.cluster"] / "launcher.py").unlink()
    assert gpu_check.stale_files(locate) == ["services/worker/step.py", "cluster/launcher.py"]


def test_the_versions_come_first_naming_torch_and_cargohold() -> None:
    lines = gpu_check.versions()
    assert lines[0].startswith("python ") and lines[1].startswith("torch ") and lines[2].startswith("cargohold 0.")
    assert not [line for line in lines if line.startswith("NOTE torch ")]  # this venv has the pinned torch


def test_the_parts_fit_six_minutes_with_the_install() -> None:
    limits = [part.limit_s for part in gpu_check.parts()]
    assert sum(limits) <= gpu_check.BUDGET_S and gpu_check.BUDGET_S + INSTALL_S <= MINUTES_6


def test_end_to_end_runs_only_after_the_gpu_tests_pass() -> None:
    python = sys.executable
    end_to_end = gpu_check.Part("end to end", [python, "-c", "print('RATIO x = 1.00')"], 30, after_tests=True)
    failing = gpu_check.Part("gpu tests", [python, "-c", "print('1 failed, 2 passed'); raise SystemExit(1)"], 30)
    figures, passed = gpu_check.run_parts([failing, end_to_end], 60)
    skipped = "end to end: skipped (no gpu test passed, or one failed)"
    assert not passed and skipped in figures
    assert "gpu tests: 1 failed, 2 passed" in figures and "gpu tests: exit 1" in figures
    no_cuda = gpu_check.Part("gpu tests", [python, "-c", "print('6 skipped, 6 deselected')"], 30)
    figures, passed = gpu_check.run_parts([no_cuda, end_to_end], 60)
    assert not passed and figures == ["gpu tests: 6 skipped, 6 deselected", skipped]
    passing = gpu_check.Part("gpu tests", [python, "-c", "print('2 passed')"], 30)
    figures, passed = gpu_check.run_parts([passing, end_to_end], 60)
    assert passed and figures == ["gpu tests: 2 passed", "end to end: RATIO x = 1.00"]


def test_a_part_gets_no_more_than_what_is_left_of_the_budget() -> None:
    slow = gpu_check.Part("pinned copies", [sys.executable, "-c", "import time; time.sleep(30)"], 30)
    figures, passed = gpu_check.run_parts([slow], 1)
    assert not passed and figures == ["pinned copies: no figure (timed out)", "pinned copies: timed out"]


@pytest.mark.parametrize("checkpointing, forwards", [("off", 1), ("blocks", 2)])
def test_the_all_in_memory_baseline_recomputes_as_the_workers_do(checkpointing: str, forwards: int) -> None:
    """benchmarks/end_to_end.py's baseline runs each block's forward again in backward
    where the workers do (activation checkpointing), so that its ratio compares like with like."""
    config = tiny_config(worker__activation_checkpointing=checkpointing)
    model = _benchmark("end_to_end").baseline_model(config, torch.device("cpu"))
    calls: list[int] = []
    block = config_task(config).blocks(model)[0][1]
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 256, (2, 8))
    _, loss = model(tokens, tokens)
    loss.backward()
    assert len(calls) == forwards
