"""Regenerate the checked-in Python code of the state-server API.

    python proto/generate.py            # write into proto/
    python proto/generate.py --out DIR  # write into DIR (the currency test diffs that)

Needs the pinned grpcio-tools of pyproject.toml's `test` extra; its bundled protoc
fixes the output, so the same inputs always give the same files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ("cargohold/v1/state_server.proto",)


def generate(out_dir: Path) -> None:
    """Run protoc over PROTO_FILES, writing _pb2.py, _pb2.pyi and _pb2_grpc.py files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
