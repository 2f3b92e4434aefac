"""The committed gRPC code must be what `make proto` generates from proto/contextd.proto today."""

from __future__ import annotations

from pathlib import Path

from contextd.protogen import GEN_PACKAGE, GENERATED, REPO, generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    produced = generate(tmp_path)
    for name in GENERATED:
        committed = (REPO / GEN_PACKAGE / name).read_bytes()
        assert (produced / name).read_bytes() == committed, (
            f"{GEN_PACKAGE}/{name} is stale: run `make proto` and commit the result")
