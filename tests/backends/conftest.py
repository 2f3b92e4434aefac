"""Fixtures for the backend suite: one suite, parametrised over runtimes and devices.

The tests only use the `Backend` protocol plus a per-runtime *harness* that reaches into the model
itself (its pre-rotary keys, its own rotary embedding, its stock cache). Adding a runtime means
adding its name to BACKENDS and a harness class here; the tests stay unchanged. A runtime that is
not importable is skipped with the reason; `cuda` is skipped unless torch sees a GPU.

Models load once per session (SmolLM2 takes ~15-25 s on 2 cores); every test works on a fork, so
tests never see each other's state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import pytest

from backends import Backend, load_backend
from backends.models import load_tokenizer, resolve
from backends.tiny_models import TINY_MODELS
from harness.corpus import sample_tokens

from .mlx_harness import MlxHarness

BACKENDS = ["torch", "mlx"]
# One tiny random-weight model per family (hidden 64, 4-6 layers), each run by the whole suite, and
# their 4-bit MLX copies made with mlx-lm's converter (MLX only).
FAMILIES = list(TINY_MODELS)
QUANTIZED = [f"{name}-q4" for name in FAMILIES]
WINDOWED = ["tiny-gemma3", "tiny-gemma4", "tiny-gpt-oss", "tiny-ministral"]
HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3-5", "tiny-qwen3-5-moe", "tiny-nemotron-h"]
DEVICES = ["cpu", "cuda"]
PREFILL_TOKENS = 1024
TEXT_TOKENS = 1536

# Runtime name -> module that must be importable for it to run.
_REQUIRES = {"torch": "torch", "mlx": "mlx"}


class Harness(Protocol):
    """What the suite needs from a runtime beyond the protocol: access to the model itself."""

    def supports_device(self, device: str) -> str | None:
        """None when `device` can run here, else the reason to skip."""
        ...

    def capture_prerope_keys(self, be: Backend, role: str = "paged"
                             ) -> contextlib.AbstractContextManager[list[list[np.ndarray]]]:
        """While active, collect the pre-rotary keys [n, heads, dim] per forward of every paged layer
        (role "paged") or every sliding-window layer (role "window")."""
        ...

    def model_rotate(self, be: Backend, keys: np.ndarray, positions: np.ndarray,
                     layer_type: str = "full_attention") -> np.ndarray:
        """The model's own rotary embedding of `layer_type` ("full_attention" or "sliding_attention")
        applied to canonical keys [layers, heads, n, dim]."""
        ...

    def stock_recurrent_after_naive_removal(self, be: Backend, token_ids: list[int], start: int,
                                            end: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Recurrent states of the stock runtime cache after prefill, and after removing [start, end)
        the way a stock runtime can (from every layer at once, recurrent ones included)."""
        ...

    def stock_logits(self, be: Backend, token_ids: list[int]) -> np.ndarray:
        """Last-position logits of the unmodified model with its stock cache and attention."""
        ...

    def fail_next_forward(self, be: Backend) -> contextlib.AbstractContextManager[None]:
        """While active, a forward pass raises RuntimeError("injected ...") half-way through."""
        ...


class TorchHarness:
    """The transformers model itself: its key modules, its rotary module and `apply_rotary_pos_emb`,
    its stock cache and attention."""

    def supports_device(self, device: str) -> str | None:
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            return "torch.cuda.is_available() is False"
        return None

    @staticmethod
    def _shape(be: Backend) -> Any:
        from backends.torch import classify

        return classify(be.hf_model)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def capture_prerope_keys(self, be: Backend, role: str = "paged") -> Iterator[list[list[np.ndarray]]]:
        import torch

        model = be.hf_model  # type: ignore[attr-defined]
        shape = self._shape(be)
        layers = list(shape.roles.paged if role == "paged" else shape.roles.window)
        captured: list[list[np.ndarray]] = [[] for _ in layers]
        tokens = {"n": 0}

        def count(module: Any, args: Any) -> None:
            tokens["n"] = int(args[0].shape[-1])

        handles = [model.get_input_embeddings().register_forward_pre_hook(count)]
        for slot, i in enumerate(layers):
            attn = shape.attention[i]
            # Where the model computes the key before rotating it: the per-head k_norm when the
            # attention has one, else the k_proj output split into heads.
            module = attn.k_norm if isinstance(getattr(attn, "k_norm", None), torch.nn.Module) else attn.k_proj

            def hook(mod: Any, args: Any, out: Any, slot: int = slot, head_dim: int = int(attn.head_dim)) -> None:
                k, n = out.detach(), tokens["n"]
                if k.dim() == 3:
                    k = k.view(1, n, -1, head_dim)
                elif k.shape[1] != n:
                    k = k.transpose(1, 2)  # [B, H, S, D] (Gemma 3's k_norm) -> [B, S, H, D]
                captured[slot].append(k[0].float().cpu().numpy())

            handles.append(module.register_forward_hook(hook))
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()

    def model_rotate(self, be: Backend, keys: np.ndarray, positions: np.ndarray,
                     layer_type: str = "full_attention") -> np.ndarray:
        """The model's rotary module (per layer type where it has several) and its own
        apply_rotary_pos_emb, whichever signature it has; keys unchanged without rotary (NoPE)."""
        import inspect

        import torch

        model = be.hf_model  # type: ignore[attr-defined]
        shape = self._shape(be)
        rotary = getattr(shape.decoder, "rotary_emb", None)
        if rotary is None:
            return np.asarray(keys, dtype=np.float32)
        layers = shape.roles.paged if layer_type == "full_attention" else shape.roles.window
        apply = sys.modules[type(shape.attention[layers[0]]).__module__].apply_rotary_pos_emb
        if "cos" not in inspect.signature(apply).parameters:
            # transformers >= 5.25 wraps it in a hub-kernel module taking (*args, **kwargs); the
            # function itself is what that module falls back to.
            apply = inspect.getclosurevars(type(apply).forward).nonlocals["func"]
        device = next(model.parameters()).device
        k = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)).to(device)
        pos = torch.from_numpy(positions.astype(np.int64))[None, :].to(device)
        with torch.no_grad():
            if "layer_type" in inspect.signature(rotary.forward).parameters:
                cos, sin = rotary(k, pos, layer_type)
            else:
                cos, sin = rotary(k, pos)
            if "k" in inspect.signature(apply).parameters:
                _, rotated = apply(k, k, cos, sin)
            else:
                rotated = apply(k, cos, sin)
        return np.asarray(rotated.float().cpu().numpy())

    def _stock_forward(self, be: Backend, token_ids: list[int], cache: Any) -> Any:
        import torch

        model = be.hf_model  # type: ignore[attr-defined]
        impl = model.config._attn_implementation
        try:
            model.config._attn_implementation = "sdpa" if model._supports_sdpa else "eager"
            with torch.no_grad():
                return model(input_ids=torch.tensor([token_ids], device=next(model.parameters()).device),
                             cache=cache, use_cache=True, logits_to_keep=1)
        finally:
            model.config._attn_implementation = impl

    def stock_recurrent_after_naive_removal(self, be: Backend, token_ids: list[int], start: int,
                                            end: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        from transformers import DynamicCache
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        cache = DynamicCache(config=be.hf_model.config)  # type: ignore[attr-defined]
        self._stock_forward(be, token_ids, cache)

        def states() -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            for i, layer in enumerate(cache.layers):
                if isinstance(layer, LinearAttentionCacheLayerMixin):
                    conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
                    assert conv is not None and recurrent is not None
                    # The linear layers update these tensors in place (copy_): copy now.
                    out[f"conv/{i}"] = conv.float().cpu().numpy().copy()
                    out[f"recurrent/{i}"] = recurrent.float().cpu().numpy().copy()
            return out

        before = states()
        # A stock runtime has no attention-only range removal. transformers' only multi-layer edits
        # are crop (tail only, refused for recurrent layers without recorded past) and reset, and
        # llama.cpp's seq_rm on a hybrid memory clears the sequence's recurrent cells: removing
        # [start, end) from the whole cache clears every layer, recurrent state included.
        with pytest.raises(RuntimeError):
            cache.crop(-(end - start))
        cache.reset()  # type: ignore[no-untyped-call]
        return before, states()

    def stock_logits(self, be: Backend, token_ids: list[int]) -> np.ndarray:
        out = self._stock_forward(be, token_ids, None)
        return np.asarray(out.logits[0, -1].float().cpu().numpy())

    @contextlib.contextmanager
    def fail_next_forward(self, be: Backend) -> Iterator[None]:
        layers = self._shape(be).decoder.layers

        def boom(module: Any, args: Any) -> None:
            raise RuntimeError("injected failure in the middle of a forward pass")

        # After the first layer has already updated its state.
        handle = layers[len(layers) // 2].register_forward_pre_hook(boom)
        try:
            yield
        finally:
            handle.remove()


HARNESSES: dict[str, type] = {"torch": TorchHarness, "mlx": MlxHarness}


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The suite's models are tiny and its ops short: with two OpenMP threads every op waits for the
    slower one, and on a shared 2-core machine that wait (a descheduled thread) made tiny decode
    steps 10-50x slower than on one thread. Exactness does not depend on it."""
    if importlib.util.find_spec("torch") is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    module = _REQUIRES.get(name, name)
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"backend {name!r} needs the module {module!r}, which is not installed")
    if name not in HARNESSES:
        pytest.skip(f"backend {name!r} has no test harness in tests/backends/conftest.py")
    return name


@pytest.fixture(scope="session")
def harness(backend_name: str) -> Harness:
    h: Harness = HARNESSES[backend_name]()
    return h


@pytest.fixture(scope="session", params=DEVICES)
def device(request: pytest.FixtureRequest, harness: Harness) -> str:
    reason = harness.supports_device(str(request.param))
    if reason is not None:
        pytest.skip(f"device {request.param}: {reason}")
    return str(request.param)


def skip_unless_runtime_has(backend: str, model: str) -> None:
    """The 4-bit copies are MLX-quantized folders: the torch backend refuses them (tested apart)."""
    if backend != "mlx" and model.endswith("-q4"):
        pytest.skip(f"{model} is an MLX-quantized copy")


@pytest.fixture(scope="session")
def text_tokens() -> list[int]:
    """Real-text token ids (SmolLM2 vocabulary, which the tiny models share)."""
    return sample_tokens(load_tokenizer(resolve("smollm2-135m")), TEXT_TOKENS)


@dataclasses.dataclass
class Prefilled:
    be: Backend
    ids: list[int]
    prerope_keys: np.ndarray  # [layers, heads, n, dim], captured from the paged layers during prefill
    window_keys: np.ndarray | None  # the same for the sliding-window layers (None without any)

    def fork(self) -> Backend:
        return self.be.fork()


def stacked(captured: list[list[np.ndarray]]) -> np.ndarray:
    """Per-forward captures [n, heads, dim] of each layer -> [layers, heads, tokens, dim]."""
    keys = np.stack([np.concatenate(chunks, axis=0) for chunks in captured])
    return keys.transpose(0, 2, 1, 3).copy()


class Models:
    """Session cache of pristine loaded backends and of 1,024-token prefilled states."""

    def __init__(self, backend: str, device: str, harness: Harness, tokens: list[int]) -> None:
        self.backend, self.device, self.harness, self.tokens = backend, device, harness, tokens
        self._pristine: dict[tuple[str, str], Backend] = {}
        self._prefilled: dict[str, Prefilled] = {}

    def fresh(self, model: str, dtype: str = "float32", **kw: Any) -> Backend:
        """An empty session of `model` (a fork of a cached load unless options are given)."""
        if kw:
            return load_backend(self.backend, model, device=self.device, dtype=dtype, **kw)
        key = (model, dtype)
        if key not in self._pristine:
            self._pristine[key] = load_backend(self.backend, model, device=self.device, dtype=dtype, capacity=1280)
        return self._pristine[key].fork()

    def prefilled(self, model: str) -> Prefilled:
        """A session holding PREFILL_TOKENS text tokens, with the pre-rotary keys seen while prefilling."""
        if model not in self._prefilled:
            be = self.fresh(model)
            ids = self.tokens[:PREFILL_TOKENS]
            windowed = bool(be.layer_roles.window)  # type: ignore[attr-defined]
            with contextlib.ExitStack() as stack:
                paged = stack.enter_context(self.harness.capture_prerope_keys(be))
                window = stack.enter_context(self.harness.capture_prerope_keys(be, "window")) if windowed else None
                be.prefill(ids)
            self._prefilled[model] = Prefilled(be, ids, stacked(paged), stacked(window) if window else None)
        return self._prefilled[model]


@pytest.fixture(scope="session")
def models(backend_name: str, device: str, harness: Harness, text_tokens: list[int]) -> Models:
    return Models(backend_name, device, harness, text_tokens)
