"""The model-native page index: the serving model's own keys, used as contextual token vectors.

Why keys, and why token by token: a page that matters to the next turn shares *tokens in context*
with it (a release number next to "passphrase", a function name in a stack trace), and the model
already writes such a vector for every token it reads: its key. At one attention layer about a
quarter of the way up, a pre-rotary key still says which token it is (so matching works in any
script the tokenizer covers) and already says what surrounds it (so "1" after "release" differs
from "1" in a line number). Scoring the incoming queries against per-page key summaries does not
work at this page size (see docs/controller.md); comparing keys with keys, token by token, does.

  index     every stored full page keeps its tokens' pre-rotary keys at the index layer, all KV
            heads side by side, in float16: 128 x kv_heads x head_dim x 2 bytes a page.
  match     vectors are centred on the mean of the indexed tokens and normalised; for each incoming
            token t and page p, m(t, p) is the best cosine between t and any token of p.
  weight    a token that matches many pages says little: w(t) = log(1 / df(t)), df(t) the share
            of candidate pages with m(t, p) >= match_threshold (at least one page).
  score     score(p) = sum_t w(t) max(0, m(t, p) - match_floor): a weak best match is noise, not
            evidence, and only what rises above the floor counts.

No text is read: the host sees key vectors and page numbers only. The index is rebuilt from the
canonical store when a session is recovered. Depends on numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KeyIndexConfig:
    layer_fraction: float = 0.25    # which attention layer: this far up the stack of attention layers
    match_threshold: float = 0.9    # cosine at which an incoming token counts as present in a page
    match_floor: float = 0.5        # cosine below which a token's best match in a page counts for nothing
    incoming_tokens: int = 256      # newest tokens of the turn that are matched

    def __post_init__(self) -> None:
        if not 0.0 <= self.layer_fraction <= 1.0:
            raise ValueError(f"layer_fraction must be in [0, 1], got {self.layer_fraction}")
        if not -1.0 < self.match_threshold < 1.0:
            raise ValueError(f"match_threshold must be in (-1, 1), got {self.match_threshold}")
        if not -1.0 <= self.match_floor < self.match_threshold:
            raise ValueError(f"match_floor must be in [-1, match_threshold), got {self.match_floor}")
        if self.incoming_tokens < 1:
            raise ValueError(f"incoming_tokens must be >= 1, got {self.incoming_tokens}")

    def layer(self, attention_layers: int) -> int:
        """The index layer, as a position in the Block's list of attention layers."""
        if attention_layers < 1:
            raise ValueError("a model without attention layers has no key index")
        return round(self.layer_fraction * (attention_layers - 1))


def token_vectors(keys: np.ndarray, layer: int) -> np.ndarray:
    """Block keys [layers, kv_heads, tokens, head_dim] -> float16 [tokens, kv_heads * head_dim]."""
    return layer_vectors(keys[layer])


def layer_vectors(layer_keys: np.ndarray) -> np.ndarray:
    """One layer's keys [kv_heads, tokens, head_dim] -> float16 [tokens, kv_heads * head_dim]."""
    return np.ascontiguousarray(np.transpose(layer_keys, (1, 0, 2)).reshape(layer_keys.shape[1], -1),
                                dtype=np.float16)


class KeyIndex:
    """Token vectors of a session's stored full pages, by page number."""

    def __init__(self, config: KeyIndexConfig, attention_layers: int) -> None:
        self.config = config
        self.layer = config.layer(attention_layers)
        self.pages: dict[int, np.ndarray] = {}

    def add(self, page: int, keys: np.ndarray) -> None:
        """Index a page from its block keys [layers, kv_heads, tokens, head_dim]."""
        self.pages[page] = token_vectors(keys, self.layer)

    def add_layer(self, page: int, layer_keys: np.ndarray) -> None:
        """Index a page from the index layer's keys alone [kv_heads, tokens, head_dim]."""
        self.pages[page] = layer_vectors(layer_keys)

    def truncate(self, pages: int) -> None:
        """Forget pages from `pages` on (the transcript was cut back)."""
        self.pages = {p: v for p, v in self.pages.items() if p < pages}

    def clear(self) -> None:
        self.pages.clear()

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.pages.values())

    def evidence(self, incoming_keys: np.ndarray, candidates: list[int], keep: np.ndarray | None = None
                 ) -> np.ndarray:
        """The score, token by token: [candidates, incoming tokens] with w(t) max(0, m(t, p) - floor),
        for the incoming tokens' Block keys (every candidate must be indexed). `keep` masks the
        incoming tokens that count (the chat template's own tokens say nothing); it is aligned at
        the end, as both are the turn's newest tokens."""
        assert candidates and all(p in self.pages for p in candidates)
        stacked = [self.pages[p] for p in candidates]
        lengths = [len(v) for v in stacked]
        tokens = np.concatenate(stacked).astype(np.float32)
        centre = tokens.mean(axis=0)
        tokens = _normalise(tokens - centre)
        incoming = token_vectors(incoming_keys, self.layer)[-self.config.incoming_tokens:].astype(np.float32)
        if keep is not None:
            n = min(len(keep), len(incoming))
            incoming = incoming[-n:][keep[-n:]] if n else incoming[:0]
        if len(incoming) == 0:
            return np.zeros((len(candidates), 0), dtype=np.float64)
        incoming = _normalise(incoming - centre)
        cosine = incoming @ tokens.T                                   # [incoming, all page tokens]
        bounds = np.cumsum([0, *lengths])
        best = np.maximum.reduceat(cosine, bounds[:-1], axis=1)        # [incoming, pages]
        present = (best >= self.config.match_threshold).mean(axis=1)
        weight = np.log(1.0 / np.clip(present, 1.0 / len(candidates), 1.0)).astype(np.float64)
        evidence: np.ndarray = (weight[:, None] * np.maximum(best - self.config.match_floor, 0.0)).T
        return evidence

    def scores(self, incoming_keys: np.ndarray, candidates: list[int]) -> np.ndarray:
        """One score per candidate page: `evidence` summed over the incoming tokens."""
        scores: np.ndarray = self.evidence(incoming_keys, candidates).sum(axis=1)
        return scores


def _normalise(x: np.ndarray) -> np.ndarray:
    unit: np.ndarray = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-6)
    return unit
