"""Gemma 3 270M (`gemma3-270m`) served: the engine on the real weights with a real contextd.

Its GGUF is the base model and has no chat template, so the tokenizer gets Gemma 3's own
(`backends.models.GEMMA3_CHAT_TEMPLATE`); the engine stops at `<end_of_turn>`. Slow: loading the
GGUF and its 262,144-token vocabulary takes a minute or two on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest

from backends import load_backend
from contextd.client import Client
from controller.selectors import HybridSelector
from serving.chat_format import ChatFormat
from serving.engine import Engine, EngineConfig
from serving.launcher import ContextdProcess
from tests.marks import needs_gemma3
from tests.serving.engines import turn

CONFIG = EngineConfig(budget_tokens=1024, tail_tokens=256, max_new_tokens=8)

pytestmark = [pytest.mark.slow, needs_gemma3]


@pytest.fixture
def engine(contextd: ContextdProcess) -> Engine:
    backend = load_backend("torch", "gemma3-270m", capacity=CONFIG.budget_tokens + 256)
    return Engine(backend, ChatFormat(backend.tokenizer), Client(contextd.socket, timeout=60.0), CONFIG,
                  HybridSelector())


def test_a_chat_turn_on_gemma3_270m(engine: Engine) -> None:
    tokenizer = engine.format.tokenizer
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in engine.decoder.stop_ids
    assert tokenizer.eos_token_id in engine.decoder.stop_ids
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Be brief."},
        {"role": "user", "content": "Which language is `def add(a, b): return a + b` written in?"},
    ]
    rendered = engine.format.render(messages, None, "default", {}).text
    assert rendered == ("<bos><start_of_turn>user\nYou are a coding agent. Be brief.\n\nWhich language is "
                        "`def add(a, b): return a + b` written in?<end_of_turn>\n<start_of_turn>model\n")
    assert engine.format.encode(rendered)[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids(
        "<start_of_turn>")]

    first = turn(engine, "g", messages)
    assert first.content.strip(), first
    assert first.completion_tokens > 0 and first.rebuilt == ""
    counters = first.counters
    assert counters.model_forward_tokens == \
        counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens
    assert counters.historical_forward_during_restore == 0

    # The next turn reuses the cache: the answer is not prefilled again, only the answer's turn end
    # and the new message are.
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": "And `fn add(a: i32, b: i32) -> i32 { a + b }`?"}]
    second = turn(engine, "g", messages)
    assert second.content.strip() and second.rebuilt == "", second
    assert second.prefilled_tokens == second.prompt_tokens - first.prompt_tokens - first.completion_tokens
