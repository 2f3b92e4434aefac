"""What a runtime found in its model, shared by a backend session, its forks and its slot store.

`LayerRoles` says what each decoder layer is to paging; `WindowShape` the K/V shape of the
sliding-window layers; `KeyLayout` how a key module lays out its output; `LoadedModel` is one
loaded model with its identity, shapes and the per-forward dispatch state the model's hooks read.
A runtime subclasses `LoadedModel` with its own model object and rotary modules.

Dependency rules: backends.blocks / errors / models / protocol only; never a tensor library.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
from typing import Any, Protocol

from .blocks import ROPE_LAYOUT_NEOX, ROPE_LAYOUT_NONE, LayerView
from .errors import BackendError, UnsupportedModelError
from .models import ModelSource
from .protocol import Counters, Tokenizer

__all__ = ["ForwardTarget", "KeyLayout", "LayerRoles", "LoadedModel", "WindowShape"]


class KeyLayout(enum.Enum):
    """How a key module lays out the keys of a forward of n tokens."""

    PROJ = "proj"  # [B, S, heads * head_dim]: a projection's output, split into heads by the store
    BSHD = "bshd"  # [B, S, heads, head_dim]
    BHSD = "bhsd"  # [B, heads, S, head_dim] (Gemma 3's k_norm)


@dataclasses.dataclass(frozen=True)
class LayerRoles:
    """What each decoder layer is to paging, found by a runtime in its model's modules and cache kinds."""

    n_layers: int
    paged: tuple[int, ...]           # global attention with its own K/V: the layers a block holds
    window: tuple[int, ...] = ()     # sliding-window attention with its own K/V: a window cache, never paged
    recurrent: tuple[int, ...] = ()  # linear attention / Mamba: conv + recurrent state, snapshotted
    shared: tuple[int, ...] = ()     # attention on another layer's K/V (Gemma 4 kv sharing): nothing of its own
    stateless: tuple[int, ...] = ()  # MLP / MoE blocks: no cache at all
    window_size: int = 0             # W: a query sees the keys of the W newest tokens, itself included

    def check(self, family: str) -> None:
        """Every layer has exactly one role, and there is something to page."""
        roles = [self.paged, self.window, self.recurrent, self.shared, self.stateless]
        seen = sorted(i for r in roles for i in r)
        if seen != list(range(self.n_layers)):
            missing = sorted(set(range(self.n_layers)) - set(seen))
            raise UnsupportedModelError(f"{family}: layers {missing or 'some'} are neither global attention, "
                                        "sliding-window attention, kv-shared attention, recurrent nor cache-free")
        if not self.paged:
            raise UnsupportedModelError(f"{family}: no global-attention layer to page"
                                        + (" (every attention layer is a sliding window)" if self.window else ""))
        if self.window and self.window_size < 2:
            raise UnsupportedModelError(f"{family}: sliding-window layers without a window size")


@dataclasses.dataclass(frozen=True)
class WindowShape:
    """The K/V shape of the sliding-window layers (all alike) and their rotary dims."""

    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    rotary_dim: int


class ForwardTarget(Protocol):
    """What the model's hooks write to during a forward: one session's store, or the rows of a
    batched decode (one session each)."""

    def observe_key(self, layer: int, out: Any) -> None: ...

    def count_entered(self, n: int) -> None: ...


@dataclasses.dataclass(kw_only=True)
class LoadedModel:
    """One loaded model, shared by a backend session and its forks; runtimes add their own fields."""

    source: ModelSource
    family: str
    roles: LayerRoles
    num_kv_heads: int      # of the paged layers, as are the dims below
    head_dim: int
    value_head_dim: int
    rotary_dim: int        # 0: no rotary embedding (NoPE)
    max_position_embeddings: int
    vocab_size: int
    model_id: str      # content hash of config and weights (slots.model_identity / folder_identity)
    dtype_name: str    # "float32", "float16" or "bfloat16"
    window: WindowShape | None = None
    key_layouts: dict[int, KeyLayout] = dataclasses.field(default_factory=dict)
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    # The store of the session whose forward is running (the model's hooks write there) and the
    # counters of the session running a page operation (a token entering the model meanwhile is
    # counted there as a historical forward: there must be none).
    active: ForwardTarget | None = None
    page_op: Counters | None = None
    tokenizer: Tokenizer | None = None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The paged layers (global attention); blocks hold exactly these."""
        return self.roles.paged

    @functools.cached_property
    def paged_index(self) -> dict[int, int]:
        """Layer -> its index among the paged layers."""
        return {layer: a for a, layer in enumerate(self.roles.paged)}

    @functools.cached_property
    def window_index(self) -> dict[int, int]:
        """Layer -> its index among the window layers."""
        return {layer: w for w, layer in enumerate(self.roles.window)}

    def key_heads(self, layer: int) -> tuple[int, int]:
        """(kv heads, head dim) of a paged or window layer."""
        if layer in self.paged_index:
            return self.num_kv_heads, self.head_dim
        assert self.window is not None
        return self.window.num_kv_heads, self.window.head_dim

    def key_layout(self, layer: int, shape: tuple[int, ...], n: int) -> KeyLayout:
        """How `layer`'s key module lays out a forward of `n` tokens. Read off the first forward whose
        length is not the head count (the load-time check is one) and kept."""
        layout = self.key_layouts.get(layer)
        if layout is None:
            heads = self.key_heads(layer)[0]
            if len(shape) == 3:
                layout = KeyLayout.PROJ
            elif n != heads and tuple(shape[1:3]) == (n, heads):
                layout = KeyLayout.BSHD
            elif n != heads and tuple(shape[1:3]) == (heads, n):
                layout = KeyLayout.BHSD
            else:
                raise BackendError(f"layer {layer}: cannot tell the key layout of {shape} yet")
            self.key_layouts[layer] = layout
        return layout

    def tokens_entered(self, n: int) -> None:
        """What the model's embedding hook reports: `n` tokens entered the model. They belong to the
        running forward (counted when it lands), and to the running page operation, if any, as a
        historical forward (there must be none)."""
        if self.page_op is not None:
            self.page_op.historical_forward_during_restore += n
        if self.active is not None:
            self.active.count_entered(n)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return self.roles.recurrent

    @property
    def view(self) -> LayerView:
        """What a block of this model means; both runtimes lay keys out in the "neox" half-split
        form (each checks its model's rotary module against that at load), or "none" without rotary."""
        return LayerView(model_id=self.model_id, family=self.family, attention_layers=self.attention_layers,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, value_head_dim=self.value_head_dim,
                         rotary_dim=self.rotary_dim,
                         rope_layout=ROPE_LAYOUT_NEOX if self.rotary_dim else ROPE_LAYOUT_NONE, dtype=self.dtype_name)
