"""RULER's long-context tasks against kv-elision, the full context and llama.cpp, in two deliveries.

RULER (Hsieh et al., NVIDIA 2024, arXiv 2404.06654) asks how much of its context a model really
uses: needles of several kinds in haystacks of several kinds (retrieval), chains of variable
assignments (multi-hop tracing) and word counts (aggregation), at lengths from 4k to 128k tokens.
kv-elision keeps a bounded attention budget however long the session: what does the model still
find when the text is 64 times the budget, and does the page that holds the answer come back?

  tasks.py    the generator, written from the paper's task definitions (not from RULER's code)
  forms.py    the two deliveries of a sample, and its length in the served model's tokens
  arms.py     the servers: kv-elision at budgets 2,048 and 4,096 as shipped, at 4,096 with
              `--follow-hops` (links, controller.links: off by default), the full context in the
              same runtime (up to the model's trained window), llama.cpp's full context
  report.py   RULER's string-match recall, likelihood recall@1, the tables, the plot, the report

Models: smollm2-135m (trained window 8k) and gemma3-270m (32k). Per cell (model, task, arm and
form, length): RULER's string-match recall of the greedy answer; likelihood recall@1 of the
expected values among the candidates, over the exact cache the answer is read from; whether each
asked-for needle was in attention when the answer started (kv-elision's servers); the median time
to first token; the number of samples.

    python -m benchmarks.ruler [--quick] [--models smollm2-135m,gemma3-270m] [--tasks niah_single_1,...]
                               [--lengths 4k,8k,16k,32k,64k,128k] [--samples N]
                               [--arms kv-2048,kv-4096,kv-4096-links,full,llama]
                               [--forms ruler,agent] [--seed 0] [--out bench-out/ruler] [--report PATH]
                               [--print-sample TASK:LENGTH:INDEX]

--quick: niah_single_1 and vt at 4k, one sample per cell, SmolLM2-135M only, the arms
kv-2048, full and llama unless --arms names others (the e2e test's run, without llama). Needs
Debian's word list (/usr/share/dict/words: `apt-get install wamerican`); llama.cpp's arm runs
once `python -m benchmarks.llamacpp` has built `llama-server`.

Writes OUT/samples.jsonl (every sample's answer, scores and needles, as it finishes), OUT/ruler.png
(recall against length per arm) and OUT/ruler.md (the tables, also docs/results/ruler.md for a run
that is not --quick). The last line is one JSON object: {"models": {MODEL: {"tasks": {TASK:
{"arms": {"ARM / FORM": {"lengths": {"4k": {"recall", "recall_at_1", "needle_in_view",
"all_in_view", "ttft_ms_p50", "samples", "status", "needles"}}}}}}}}, ...} (null where not applicable).
"""
