#!/usr/bin/env python3
"""Regenerate the Python gRPC code and .pyi stubs from proto/kvmem/v1/*.proto.

The .proto files sit at their package path (proto/kvmem/v1/), so protoc writes modules
that import each other as ``kvmem.v1.*`` with no post-processing. Usage:

    python proto/generate.py            # write proto/kvmem/v1/*_pb2*.py{,i}
    python proto/generate.py --check    # exit 1 if the committed code is stale
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE = Path("kvmem") / "v1"


def _googleapis_protos() -> Path:
    """Where googleapis-common-protos keeps ``google/rpc/status.proto`` (a dependency of
    grpcio-status, which kvmem needs anyway): the include root for the import."""
    from google.rpc import status_pb2

    return Path(status_pb2.__file__).resolve().parents[2]


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto of the package into out_dir; return the files made."""
    from grpc_tools import protoc  # a test extra: `pip install kvmem[test]`

    include = Path(protoc.__file__).parent / "_proto"
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
    f"-I{_googleapis_protos()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    return sorted(p.relative_to(out_dir) for p in (out_dir / PACKAGE).glob("*_pb2*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        made = generate(Path(tmp))
        if args.check:
            stale = [
                str(rel)
                for rel in made
                if not (PROTO_ROOT / rel).exists() or not filecmp.cmp(Path(tmp) / rel, PROTO_ROOT / rel, shallow=False)
            ]
            if stale:
                print("generated code is stale, run `python proto/generate.py`: " + ", ".join(stale))
                return 1
            print(f"generated code is current ({len(made)} files)")
            return 0
        for rel in made:
            shutil.copyfile(Path(tmp) / rel, PROTO_ROOT / rel)
            print(f"wrote proto/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
