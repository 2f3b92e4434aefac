"""The interpreter's garbage collector, set for a process that serves a loaded model.

Python's collector walks every tracked object it holds in a generation. A loaded server holds
hundreds of thousands of them (torch, transformers and the model's modules), and a full
collection walked them all: a stop of the whole server, which a turn or a restore that happened
to be running waited out. They live as long as the process, so `gc.freeze()` moves them out of
the collector's sight once they are loaded, and a full collection after it is next to free.

The first generation is collected each time the tracked objects allocated and not yet freed pass
its threshold (700 by default). Restoring one SmolLM2 page holds a few hundred short-lived ones at
once (the buffer views its 180 key and value runs land through, the file's read requests), so a
warm restore and eviction ran about one collection each, mid-restore; with the threshold at
10,000, warm restores ran none. Nearly everything a turn allocates is freed by its reference count
before a collection would see it, so collecting less often costs little memory: what cyclic
garbage there is waits for 10,000 allocations instead of 700.

Figures (object counts, collection times, restores counted with `gc.callbacks`):
docs/journal/2026-11-29-restore-path.md ("The garbage collector") and
docs/journal/2026-11-30-scale.md.

Dependency rules: standard library only.
"""

from __future__ import annotations

import gc
from typing import Any

FIRST_GENERATION_THRESHOLD = 10_000


def freeze_loaded_heap() -> None:
    """Call once the model and everything that lives as long as the process are loaded: what is
    allocated so far is never walked by the collector again, and the first generation is
    collected every FIRST_GENERATION_THRESHOLD allocations instead of 700."""
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(FIRST_GENERATION_THRESHOLD, second, third)


def heap_figures() -> dict[str, Any]:
    """What /v1/kv/stats shows of the collector: the objects frozen, its thresholds, and the
    collections of each generation since the process started."""
    return {"frozen_objects": gc.get_freeze_count(), "thresholds": list(gc.get_threshold()),
            "collections": [generation["collections"] for generation in gc.get_stats()]}
