"""Several sessions on one server: a branch, switches, concurrent decode, a short request behind a long answer.

    python -m benchmarks.sessions [--model smollm2-135m] [--tokens 16000] [--budget 4096]

One real `kv-elision serve` and its contextd, driven over HTTP as agents drive it (the whole
transcript in every request; harness.workload's `read` results):

- **branch** (per size in `--tokens`): a parent session grown past that size, then a new session id
  that sends the parent's messages up to its last user message and a new question, as Pi's `/fork`
  does. `branch_prefill_fraction` is the tokens the branch prefilled over its prompt tokens,
  `branch_ttft_ms` its time to the first streamed content, and `fresh_ttft_ms_estimate` what a
  server that shares nothing would take: the prompt at the prefill rate of the parent's own build;
- **switches**: sessions of about one budget each, answered in turn, on a server holding
  `--resident-sessions` caches (2): between two resident sessions (`switch_ms_p50` / `_p95`, the
  engine's time to bring the other session in: `last_turn.activate_ms`), and round-robin over one
  session more than there are caches, so every turn restores its working set from the store
  (`switch_from_store_ms_p50` / `_p95`);
- **decode**: 1, 2 and 4 sessions asking for `--decode-tokens` each at the same moment, on a
  server of their own with 4 resident caches (made before timing); the aggregate decode rate
  while all of them decode (`decode_tok_s`: streamed chunks, about one a token, from the last
  session's first to the first session's last, so neither prefill nor a tail after one story
  ended is in it; `decode_tok_s_overall`: completion tokens from send to the last end), and
  `decode_speedup_2` / `_4` over one session's, with batched decode (the default) and, side by
  side on another such server, with `--no-batch-decode` (`decode_speedup_4_unbatched`: turns
  interleaved a token at a time, each its own forward);
- **busy**: a short request in another session while one session decodes `--decode-tokens` (on
  the batching server); `ttft_ratio_busy` is its time to first content over the same request's
  on an idle server.

Last line: one JSON object with those figures, `other_processes_cpu_share` and `reliable`
(benchmarks.stats: false above 10%).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import percentile, print_result
from harness.agent import AgentRun
from harness.procfs import machine_cpu_seconds, other_cpu_share, own_cpu_seconds
from harness.workload import TOOLS, evidence_files
from serving.launcher import ServerProcess

SWITCH_TURNS = 12
QUESTION = {"role": "user", "content": "Which file defined the retry limit? Answer with the file name."}


def streamed(server: ServerProcess, messages: list[dict[str, Any]], session: str, max_tokens: int,
             tools: bool = True, decoding: threading.Event | None = None,
             arrivals: list[float] | None = None) -> tuple[float, float, dict[str, Any]]:
    """(ms to the first content chunk, ms to the end, the final chunk's usage and the prefilled
    tokens) of one streamed request; with `tools`, the workload's tool schemas go with it;
    `decoding` is set when the first content arrives; `arrivals` gets each content chunk's
    arrival time (time.perf_counter)."""
    started = time.perf_counter()
    reply = server.stream(messages, session, **({"tools": TOOLS} if tools else {}), max_tokens=max_tokens,
                          stream_options={"include_usage": True})
    if reply.status != 200:
        raise RuntimeError(f"{session}: {reply.status} {reply.error[:300]}")
    first = None
    usage: dict[str, Any] = {}
    for arrived, chunk in reply.chunks():
        content = any(c.get("delta", {}).get("content") or c.get("delta", {}).get("tool_calls")
                      for c in chunk.get("choices", []))
        if content and arrivals is not None:
            arrivals.append(arrived)
        if first is None and content:
            first = arrived
            if decoding is not None:
                decoding.set()
        usage = chunk.get("usage") or usage
    ended = time.perf_counter()
    first = ended if first is None else first
    return (first - started) * 1e3, (ended - started) * 1e3, {
        "usage": usage, "prefilled": int(reply.headers.get("x-kv-prefilled-tokens") or 0)}


def grown(server: ServerProcess, session: str, tokens: int, seed: int) -> AgentRun:
    run = AgentRun(server, session, max_tokens=8)
    run.run(evidence_files(tokens // 900 + 2, tokens_per_file=1000, seed=seed), until_tokens=tokens)
    return run


def branch(server: ServerProcess, size: int, seed: int) -> dict[str, Any]:
    parent = grown(server, f"parent-{size}", size, seed)
    # tokens a second the parent's turns prefilled (their few decoded tokens included), the first
    # turn left out: it also pays the server's warm-up
    prefill_rate = percentile([t.prefilled / t.seconds for t in parent.turns[1:]], 50)
    last_user = max(i for i, m in enumerate(parent.messages) if m["role"] == "user")
    fork = [*parent.messages[:last_user], QUESTION]
    ttft, total, reply = streamed(server, fork, f"branch-{size}", max_tokens=8)
    stats = server.stats(f"branch-{size}")
    prompt = reply["usage"]["prompt_tokens"]
    counters = stats["counters"]
    return {"parent_tokens": parent.turns[-1].session_tokens, "prompt_tokens": prompt,
            "prefilled_tokens": reply["prefilled"],
            "branch_prefill_fraction": round(reply["prefilled"] / prompt, 4),
            "branch_ttft_ms": round(ttft, 1), "branch_total_ms": round(total, 1),
            "fresh_ttft_ms_estimate": round(prompt / prefill_rate * 1e3, 1),
            "branches": counters["branches"], "historical_forward": counters["historical_forward_during_restore"],
            "forward_invariant": counters["model_forward_tokens"] == counters["new_prefill_tokens"]
            + counters["decoded_tokens"] + counters["blend_forward_tokens"]}


def switches(server: ServerProcess, budget: int, resident: int, seed: int) -> dict[str, Any]:
    runs = [grown(server, f"switch-{n}", budget, seed + n) for n in range(resident + 1)]

    def round_robin(sessions: list[AgentRun], restored: bool) -> list[float]:
        """activate_ms of each turn, round-robin, that restored pages from the store (or did not)."""
        activate = []
        turn = 0
        while len(activate) < SWITCH_TURNS:
            if turn > 4 * SWITCH_TURNS:
                raise RuntimeError(f"round-robin over {len(sessions)} sessions: only {len(activate)} turns "
                                   f"{'restored' if restored else 'stayed resident'}")
            run = sessions[turn % len(sessions)]
            before = run.turns[-1].counters["recovered_pages"]
            record = run.ask([{"role": "user", "content": f"Turn {turn}: one more word."}])
            if (record.counters["recovered_pages"] > before) == restored and turn >= len(sessions):
                activate.append(server.stats(run.session_id)["last_turn"]["activate_ms"])
            turn += 1
        return activate

    between = round_robin(runs[:2], restored=False)   # both resident once each has had a turn
    from_store = round_robin(runs, restored=True)     # one session more than caches: misses
    return {"switch_ms_p50": round(percentile(between, 50), 1), "switch_ms_p95": round(percentile(between, 95), 1),
            "switch_from_store_ms_p50": round(percentile(from_store, 50), 1),
            "switch_from_store_ms_p95": round(percentile(from_store, 95), 1), "switch_samples": len(between)}


def at_once(server: ServerProcess, sessions: int, tokens: int) -> tuple[float, list[int], list[list[float]]]:
    """`sessions` requests sent at once, each its own session new to the server: the seconds from
    send to the last end, each one's completion tokens and its content chunks' arrival times."""
    done: list[int] = []
    arrivals: list[list[float]] = [[] for _ in range(sessions)]
    ready = threading.Barrier(sessions + 1)

    def one(n: int) -> None:
        messages = [{"role": "user", "content": f"Session {n} of {sessions}: write a long story about a ship."}]
        ready.wait()
        _, _, reply = streamed(server, messages, f"decode-{sessions}-{tokens}-{n}", tokens, tools=False,
                               arrivals=arrivals[n])
        done.append(int(reply["usage"]["completion_tokens"]))

    threads = [threading.Thread(target=one, args=(n,)) for n in range(sessions)]
    for thread in threads:
        thread.start()
    ready.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, done, arrivals


def decode(server: ServerProcess, sessions: int, tokens: int) -> tuple[float, float]:
    """The aggregate decode rate of `sessions` sessions asked at once while all of them decode
    (content chunks, about one a token, from the last session's first to the first session's last:
    neither a prefill nor a batch that lost a finished session is in it), and the aggregate
    completion tokens a second from send to the last end."""
    seconds, done, arrivals = at_once(server, sessions, tokens)
    start, end = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
    together = sum(sum(1 for t in a if start < t <= end) for a in arrivals)
    if together < 8 * sessions:
        raise RuntimeError(f"{sessions} sessions decoded together for only {together} chunks; ask for more tokens")
    return together / (end - start), sum(done) / seconds


def busy(server: ServerProcess, tokens: int) -> dict[str, Any]:
    short = [{"role": "user", "content": "Say yes."}]
    idle, _, _ = streamed(server, short, "busy-idle", max_tokens=4, tools=False)
    decoding = threading.Event()
    long_answer = threading.Thread(target=streamed, args=(
        server, [{"role": "user", "content": "Write a very long story about a lighthouse."}], "busy-long", tokens,
        False, decoding))
    long_answer.start()
    if not decoding.wait(600):
        raise RuntimeError("the long answer never started")
    waited, _, _ = streamed(server, short, "busy-short", max_tokens=4, tools=False)
    long_answer.join()
    return {"ttft_idle_ms": round(idle, 1), "ttft_busy_ms": round(waited, 1),
            "ttft_ratio_busy": round(waited / idle, 2)}


def concurrency(model: str, budget: int, tokens: int, work: Path, batched: bool) -> dict[str, Any]:
    """Decode rates of 1, 2 and 4 sessions at once, and the busy figures when `batched`, on a
    server of their own holding 4 resident caches."""
    server = ServerProcess(root=work / ("batched" if batched else "unbatched"), model=model, budget=budget,
                           extra=["--max-new-tokens", str(max(tokens, 256)),
                                  "--tail-tokens", str(min(512, budget // 4)), "--resident-sessions", "4",
                                  *([] if batched else ["--no-batch-decode"])])
    try:
        server.start(timeout=600)
        at_once(server, 4, 1)   # warm-up: the four caches exist before anything is timed (a new one is a fork)
        rates = {n: decode(server, n, tokens) for n in (1, 2, 4)}
        return {"rates": {n: r[0] for n, r in rates.items()}, "overall": {n: r[1] for n, r in rates.items()},
                **(busy(server, tokens) if batched else {})}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", default="16000", help="comma-separated parent sizes (e.g. 16000,128000)")
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--resident-sessions", type=int, default=2)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    machine0, ours0 = machine_cpu_seconds(), own_cpu_seconds()
    work = Path(tempfile.mkdtemp(prefix="kvb-sessions-", dir="/tmp"))
    server = ServerProcess(root=work / "root", model=args.model, budget=args.budget,
                           extra=["--max-new-tokens", str(max(args.decode_tokens, 256)),
                                  "--tail-tokens", str(min(512, args.budget // 4)),
                                  "--resident-sessions", str(args.resident_sessions)])
    try:
        server.start(timeout=600)
        branches = {str(size): branch(server, int(size), args.seed) for size in args.tokens.split(",")}
        switched = switches(server, args.budget, args.resident_sessions, args.seed + 100)
        server.stop()
        batched = concurrency(args.model, args.budget, args.decode_tokens, work, batched=True)
        unbatched = concurrency(args.model, args.budget, args.decode_tokens, work, batched=False)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    rates, alone, overall = batched.pop("rates"), unbatched["rates"], batched.pop("overall")
    waited = batched
    first = branches[args.tokens.split(",")[0]]
    result: dict[str, Any] = {
        "model": args.model, "budget_tokens": args.budget, "branches": branches,
        "branch_prefill_fraction": first["branch_prefill_fraction"], "branch_ttft_ms": first["branch_ttft_ms"],
        **switched, "decode_tok_s": {str(n): round(r, 2) for n, r in rates.items()},
        "decode_speedup_2": round(rates[2] / rates[1], 2), "decode_speedup_4": round(rates[4] / rates[1], 2),
        "decode_tok_s_unbatched": {str(n): round(r, 2) for n, r in alone.items()},
        "decode_tok_s_overall": {str(n): round(r, 2) for n, r in overall.items()},
        "decode_speedup_4_unbatched": round(alone[4] / alone[1], 2), **waited}
    other = other_cpu_share(machine0, machine_cpu_seconds(), own_cpu_seconds() - ours0)
    for size, figures in branches.items():
        print(f"branch of a {figures['parent_tokens']:,}-token session ({size}): prefilled "
              f"{figures['prefilled_tokens']} of {figures['prompt_tokens']} tokens, first token in "
              f"{figures['branch_ttft_ms']} ms (a fresh prefill: ~{figures['fresh_ttft_ms_estimate']} ms)")
    print(f"switch between two resident sessions: p50 {switched['switch_ms_p50']} ms, p95 {switched['switch_ms_p95']} "
          f"ms; from the store: p50 {switched['switch_from_store_ms_p50']} ms, p95 "
          f"{switched['switch_from_store_ms_p95']} ms")
    print(f"decode tok/s with 1/2/4 sessions: {result['decode_tok_s']} batched, "
          f"{result['decode_tok_s_unbatched']} each alone")
    print(f"first token behind a {args.decode_tokens}-token answer: {waited['ttft_busy_ms']} ms "
          f"({waited['ttft_ratio_busy']}x idle)")
    print_result(result, other)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
