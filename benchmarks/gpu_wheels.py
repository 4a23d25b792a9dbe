"""`make gpu-wheels`: the packages a bare GPU machine lacks, as wheels in one folder.

    python benchmarks/gpu_wheels.py .whl

The GPU machines this project borrows have Python with CUDA torch, and no network. This
fetches (here, from PyPI) what cargohold needs beyond that image, for CPython 3.12 on
x86-64 Linux, and builds cargohold's own wheel; ``make gpu-check`` installs them there.
Ray's wheel (79 MB) carries a Java jar (ray_dist.jar, 32 MB) only Java workers use: it is
taken out so that everything travels in the 64 MiB a call may carry.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINS = (
    "ray==2.60.0",
    "grpcio==1.85.1",
    "grpcio-health-checking==1.85.1",
    "protobuf==7.36.2",
    "google-crc32c==1.9.0",
    # ray's own needs the image lacks
    "jsonschema==4.25.1",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==0.30.0",
)
GPU_IMAGE = (
    "torch",
    "numpy",
    "pyyaml",
    "tqdm",
    "safetensors",
    "prometheus-client",
    "pytest",
    "pytest-timeout",
    "hypothesis",
    "transformers",
    "accelerate",
    "setuptools",
    "wheel",
)
"""What the GPU image already holds of cargohold's requirements, its test extras and its
build (device/KINDS.md's package list, 2026-11-17); anything else of them is absent there
unless PINS carries it (tests/test_gpu_check.py collects the gpu tests without the rest)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
JAVA_ONLY = "ray/jars/"


def strip_ray(wheel: Path) -> None:
    """Rewrite ray's wheel without its Java jars (and their RECORD lines)."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if item.filename.startswith(JAVA_ONLY):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n") if not line.startswith(JAVA_ONLY.encode()))
            target.writestr(item, data)
    slim.replace(wheel)


def main() -> int:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".whl").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
         *platforms, "-d", str(folder), *PINS],
        check=True,
    )  # fmt: skip
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(folder), str(ROOT)], check=True)
    for wheel in folder.glob("ray-*.whl"):
        strip_ray(wheel)
    total = sum(path.stat().st_size for path in folder.glob("*.whl"))
    print(f"{folder}: {total / 2**20:.1f} MiB of wheels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
