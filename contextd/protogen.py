"""Regenerate contextd's gRPC code from proto/contextd.proto (`make proto`).

The generated modules live in contextd/_gen and are committed; `tests/contextd/test_proto_fresh.py`
regenerates them into a temporary folder and fails when the committed copy is stale.
Depends on grpcio-tools only.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO = REPO / "proto" / "contextd.proto"
GEN_PACKAGE = "contextd/_gen"
GENERATED = ("contextd_pb2.py", "contextd_pb2.pyi", "contextd_pb2_grpc.py")


def generate(out_root: Path) -> Path:
    """Run protoc so the modules land in out_root/contextd/_gen; return that folder."""
    from grpc_tools import protoc

    # Mapping the proto folder onto the package path makes the generated grpc module import
    # `from contextd._gen import contextd_pb2`, so no post-processing of generated code is needed.
    args = [
        "protoc",
        f"-I{GEN_PACKAGE}={PROTO.parent}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        str(PROTO),
    ]
    (out_root / GEN_PACKAGE).mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return out_root / GEN_PACKAGE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        produced = generate(Path(tmp))
        target = REPO / GEN_PACKAGE
        target.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copyfile(produced / name, target / name)
    print(f"generated {', '.join(GENERATED)} in {GEN_PACKAGE}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
