"""The checked-in protobuf code is what proto/generate.py makes from the .proto files now.

Regenerates into a temporary folder with the pinned grpcio-tools and compares bytes, so
an edit to a .proto file without regenerating fails here rather than at runtime.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

PROTO_ROOT = Path(__file__).resolve().parents[1] / "proto"
GENERATED = (
    "cargohold/v1/state_server_pb2.py",
    "cargohold/v1/state_server_pb2.pyi",
    "cargohold/v1/state_server_pb2_grpc.py",
)
FIX = "the checked-in protobuf code is stale; run `python proto/generate.py` and commit the result"


def test_checked_in_code_equals_fresh_generation(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(PROTO_ROOT / "generate.py"), "--out", str(tmp_path)],
        check=True,
        timeout=100,
    )
    produced = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert produced == sorted(GENERATED), f"generate.py wrote {produced}, expected {sorted(GENERATED)}"
    for name in GENERATED:
        fresh = (tmp_path / name).read_bytes()
        checked_in = PROTO_ROOT / name
        assert checked_in.is_file(), f"proto/{name} is missing: {FIX}"
        assert checked_in.read_bytes() == fresh, f"proto/{name} differs from a fresh generation: {FIX}"
