"""An MLX process serving a folder keeps torch out (`backends.models.keep_torch_out`): transformers
5 imports torch whenever it is installed, ~240 MB of peak RSS an MLX session never uses."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from backends.models import keep_torch_out
folder = sys.argv[1]
assert not keep_torch_out("smollm2-135m"), "a GGUF needs torch"
assert keep_torch_out(folder)
from backends import load_backend
be = load_backend("mlx", folder, dtype="auto", capacity=64)
ids = be.tokenizer.encode("The sea is")
be.prefill(ids)
print(be.decode(), be.decode(), sys.modules["torch"] is None)
"""


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="MLX is not installed")
def test_mlx_folder_session_runs_without_torch() -> None:
    from backends.mlx import quantized_copy
    from backends.models import resolve

    folder = quantized_copy(resolve("tiny-llama-q4"))  # built in this process, torch allowed
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second, kept_out = done.stdout.split()
    assert kept_out == "True"
    from backends import load_backend

    be = load_backend("mlx", str(folder), dtype="auto", capacity=64)
    be.prefill(be.tokenizer.encode("The sea is"))
    assert [be.decode(), be.decode()] == [int(first), int(second)]
