"""docs/architecture.md's map of one update is what a trace of one update shows
(tests/update_trace.py): the same package files, co-located and remote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP_START, MAP_END = "<!-- update-map:start -->", "<!-- update-map:end -->"

pytestmark = pytest.mark.timeout(300)


def _documented() -> dict[str, set[str]]:
    """The files the map marks for each path ("co-located", "remote")."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text[text.index(MAP_START) + len(MAP_START) : text.index(MAP_END)]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    return {
        path: {row[0].strip("`") for row in rows if row[column] == "yes"}
        for column, path in ((1, "co-located"), (2, "remote"))
    }


def _traced(path: str) -> set[str]:
    argv = [sys.executable, str(ROOT / "tests" / "update_trace.py")] + (["remote"] if path == "remote" else [])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT / "tests")
    assert done.returncode == 0, done.stderr[-4000:]
    return set(done.stdout.split())


@pytest.mark.parametrize("path", ["co-located", "remote"])
def test_the_map_lists_the_files_one_update_crosses(path: str) -> None:
    documented, traced = _documented()[path], _traced(path)
    assert traced, "the trace recorded nothing"
    assert documented == traced, (
        f"docs/architecture.md's map ({path}) differs from the trace: missing {sorted(traced - documented)}, "
        f"not crossed {sorted(documented - traced)}"
    )
