"""The `kv-elision` command: `serve` runs the OpenAI-compatible server on a model; `models` lists the
models found on this machine (Hugging Face cache, LM Studio) and whether each can be served exactly.

`kv-elision serve --model smollm2-135m --budget 4096 --root DIR --port 8088` connects to the
contextd on `--socket` when one answers there, and otherwise starts one (as a child process that
lives and dies with the server) with its data under `DIR/contextd`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from backends.errors import BackendError
from contextd.client import Client
from contextd.errors import DaemonUnavailable
from contextd.paths import default_root, default_socket
from controller.blend import DEFAULT_BLEND, PARTS, BlendPolicy
from controller.eviction import EVICTION_ORDERS
from controller.links import FOLLOW_HOPS, LinkConfig
from controller.selectors import SELECTORS, make_selector
from serving.engine import PLACEMENTS, Engine, EngineConfig
from serving.heap import freeze_loaded_heap
from serving.launcher import API_KEY_FILE, ContextdProcess, server_api_key, spawn_tied_contextd
from serving.scoring import ControllerConfig, ControllerScorer
from serving.worker import STUCK_AFTER_S

if TYPE_CHECKING:
    from backends import Backend

log = logging.getLogger("kv_elision")


def _connect_or_spawn_contextd(root: Path, socket_path: Path) -> tuple[Client, ContextdProcess | None]:
    """The contextd answering on `socket_path`, else a new one under ROOT/contextd that dies with us,
    spawned: the caller loads its model while it starts, then calls `wait_started`, which took
    seconds off a SmolLM2 server's start to /health; most of the rest is importing torch and
    transformers (docs/journal/2026-12-01-models.md).
    Without a socket file nobody can be answering, and nobody is asked."""
    if socket_path.exists():
        client = Client(socket_path)
        try:
            client.wait_ready(timeout=0.5)
            log.info("using the contextd already serving %s", socket_path)
            return client, None
        except DaemonUnavailable:
            client.close()
    daemon = spawn_tied_contextd(root / "contextd", socket_path)
    assert daemon.proc is not None and daemon.client is not None
    log.info("starting contextd (pid %d) on %s", daemon.proc.pid, socket_path)
    return daemon.client, daemon


def _controller(args: argparse.Namespace, backend: Backend) -> ControllerScorer | None:
    """The separate controller model `--controller-model` names, loaded on the serving runtime."""
    if args.controller_model is None:
        return None
    from backends import load_backend

    controller = load_backend(args.backend, args.controller_model, device=args.device, dtype=args.dtype,
                              capacity=ControllerConfig.max_page_tokens)
    return ControllerScorer(controller, backend.tokenizer, ControllerConfig(cache_bytes=args.controller_cache_mb << 20))


def cmd_serve(args: argparse.Namespace) -> int:
    from backends import load_backend
    from serving.chat_format import ChatFormat
    from serving.http import Server

    if args.controller_model is not None and args.selector != "rerank" and args.evict_order != "model":
        raise ValueError("--controller-model scores pages for --selector rerank and --evict-order model; "
                         "with neither it would have nothing to do")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.stuck_after <= 0:
        raise ValueError(f"--stuck-after must be > 0 seconds, got {args.stuck_after}")
    if args.controller_cache_mb < 0:
        raise ValueError(f"--controller-cache-mb must be >= 0, got {args.controller_cache_mb}")
    if args.backend == "mlx":
        from backends.models import keep_torch_out

        keep_torch_out(args.model)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    root = Path(args.root)
    socket_path = Path(args.socket) if args.socket else default_socket(root)
    config = engine_config(args)
    client, daemon = _connect_or_spawn_contextd(root, socket_path)
    try:
        backend = load_backend(args.backend, args.model, device=args.device, dtype=args.dtype,
                               capacity=args.budget + 256)
        if daemon is not None:
            daemon.wait_started()
        controller = _controller(args, backend)
        template = Path(args.chat_template).read_text() if args.chat_template else None
        engine = Engine(backend, ChatFormat(backend.tokenizer, template), client, config,
                        make_selector(args.selector, args.restore_pages, args.follow_hops), controller)
        server = Server(engine, args.model, args.host, args.port, str(socket_path),
                        args.api_key or server_api_key(root), client_timeout=args.client_timeout,
                        restore_pages=args.restore_pages, stuck_after=args.stuck_after)
        freeze_loaded_heap()
        # The drain runs beside serve_forever (which its first step ends); contextd is stopped
        # only once it is over, since the turns it finishes or cuts are written through contextd.
        drain = threading.Thread(target=server.shutdown, args=(args.drain_timeout,), name="kv-elision-drain",
                                 daemon=True)

        def on_signal(signum: int, _frame: object) -> None:
            """SIGTERM / SIGINT: drain; a second one cuts the turns still running now."""
            if drain.ident is None:
                log.info("signal %d: stopping; turns running may finish for %g s", signum, args.drain_timeout)
                drain.start()
            else:
                server.cut_now()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        print(f"kv-elision: serving {args.model} ({args.backend}/{args.device}) on http://{args.host}:{server.port}/v1 "
              f"with a {args.budget}-token attention budget; contextd at {socket_path}", file=sys.stderr, flush=True)
        try:
            server.serve_forever()
        finally:
            if drain.ident is None:   # serve_forever failed: the turns running are still drained
                drain.start()
            drain.join()
    finally:
        if daemon is not None:
            daemon.stop()
        else:
            client.close()
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """Every model found offline, with per runtime "exact" or the reason it cannot be served exactly."""
    import json

    from backends.model_listing import list_local_models
    from backends.models import hf_cache_roots, lmstudio_model_roots
    from backends.tiny_models import TINY_MODELS

    found = list_local_models()
    if args.json:
        print(json.dumps([{"name": m.name, "path": str(m.path), "origin": m.origin, "format": m.format,
                           "family": m.family, "runtimes": m.runtimes} for m in found], indent=1))
        return 0
    for m in found:
        print(f"{m.name}  [{m.format}, {m.family}, {m.origin}]  {m.path}")
        for runtime, reason in m.runtimes.items():
            print(f"    {runtime:<6} {'exact' if reason is None else 'no: ' + reason}")
    roots = [*hf_cache_roots(), *lmstudio_model_roots()]
    print(f"searched: {', '.join(str(r) for r in roots)}")
    print(f"built in: smollm2-135m, gemma3-270m (with the gemma3 extra), {', '.join(TINY_MODELS)} "
          "(smollm2-135m and the tiny ones also as -q4 / -q8: MLX-quantized, --backend mlx)")
    return 0


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration `serve`'s flags name (ValueError for a value out of range): what a
    benchmark that drives the engine in-process builds it from, so it serves as `serve` would."""
    blend = None
    if args.blend is not None or args.blend_heads != DEFAULT_BLEND.heads or args.blend_budget != DEFAULT_BLEND.budget:
        named = DEFAULT_BLEND.parts if args.blend is None else args.blend.split(",")
        parts = tuple(p.strip() for p in named if p.strip() and p.strip() != "none")
        blend = BlendPolicy(parts=parts, heads=args.blend_heads, budget=args.blend_budget)
    return EngineConfig(budget_tokens=args.budget, max_new_tokens=args.max_new_tokens,
                        tail_tokens=args.tail_tokens, lease_turns=args.lease_turns,
                        compress_pages=args.compress == "zstd", placement=args.placement, blend=blend,
                        resident_sessions=args.resident_sessions, sessions_in_memory=args.sessions_in_memory,
                        batch_decode=args.batch_decode,
                        session_lease_s=args.session_lease, evict_order=args.evict_order)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-elision", description="a local model server whose context never compacts")
    sub = parser.add_subparsers(dest="verb", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API")
    model = serve.add_argument_group("model")
    budget = serve.add_argument_group("attention budget")
    sessions = serve.add_argument_group("sessions")
    place = serve.add_argument_group("data, network and shutdown")
    policy = serve.add_argument_group(
        "policies the benchmarks compare", "the defaults are the measured choices (docs/results/); the others are "
        "there to measure against them")
    model.add_argument("--model", default="smollm2-135m", help="model name, local HF folder or .gguf path")
    model.add_argument("--backend", default="torch", choices=["torch", "mlx"])
    model.add_argument("--device", default="cpu", help="cpu or cuda (torch)")
    model.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    budget.add_argument("--budget", type=int, default=4096, help="attention budget in tokens")
    budget.add_argument("--tail-tokens", type=int, default=512, help="recent tokens that always stay in attention")
    budget.add_argument("--lease-turns", type=int, default=2, help="turns a restored page stays in attention")
    policy.add_argument("--compress", default="none", choices=["none", "zstd"],
                       help="store pages losslessly compressed (byte planes + zstd: ~1.2x for float32 K/V, "
                       "~1.5x for bfloat16; see docs/contextd.md for what a restore pays)")
    policy.add_argument("--placement", default=EngineConfig.placement, choices=list(PLACEMENTS),
                       help="where a turn's restored pages sit while its answer is read: at their place in the "
                       "timeline, or right before the new message (docs/proof.md measures both)")
    policy.add_argument("--blend", default=None, metavar="PARTS",
                       help="held tokens each turn recomputes in the current view before the answer, by part: "
                       f"a comma list of {', '.join(p for p in PARTS if p != 'heads')}, or none (counted as "
                       "blend_forward_tokens; the stored K/V stay exact; default: "
                       f"{','.join(DEFAULT_BLEND.parts) or 'none'}, none on a model with recurrent layers; "
                       "docs/server.md)")
    policy.add_argument("--blend-heads", type=int, default=DEFAULT_BLEND.heads, metavar="K",
                       help="also recompute the first K tokens of every run of consecutive pages in the view")
    policy.add_argument("--blend-budget", type=float, default=DEFAULT_BLEND.budget, metavar="SHARE",
                       help="at most this share of the view's tokens is recomputed per turn (0..1)")
    policy.add_argument("--evict-order", default=EngineConfig.evict_order, choices=list(EVICTION_ORDERS),
                       help="which pages leave attention first: the oldest (recency); of the oldest the pager may "
                       "evict, those least related to the last user message, scored by the serving model over their "
                       "K/V or by --controller-model (model: a scoring forward when the budget is crossed); or those "
                       "the model's own attention read least in the forwards it ran anyway (attention; "
                       "docs/controller.md measures them)")
    policy.add_argument("--controller-model", default=None, metavar="NAME",
                       help="a separate full-attention model (any name --model takes) that scores pages for "
                       "--selector rerank and --evict-order model from their text, instead of the serving model over "
                       "their K/V: it costs the controller's forwards, not the serving model's, and works for hybrid "
                       "and sliding-window serving models (docs/controller.md)")
    policy.add_argument("--controller-cache-mb", type=int, default=ControllerConfig.cache_bytes >> 20, metavar="MB",
                       help="memory for the controller's K/V of pages it already read (each page is prefilled by "
                       "the controller once while it stays here)")
    model.add_argument("--max-new-tokens", type=int, default=1024, help="cap on tokens generated per turn")
    sessions.add_argument("--resident-sessions", type=int, default=1, metavar="N",
                       help="sessions whose caches stay in memory, least recently used out (each holds a budget's "
                       "worth of K/V: kv_bytes_per_token x (budget + 256)); a turn for a resident session moves no "
                       "page, another restores its working set from the store")
    sessions.add_argument("--sessions-in-memory", type=int, default=EngineConfig.sessions_in_memory, metavar="N",
                       help="sessions whose transcript, pager and page indexes stay in memory, least recently used "
                       "out (at least --resident-sessions); one that left comes back from contextd at its next turn, "
                       "with no prefill of history")
    sessions.add_argument("--batch-decode", action=argparse.BooleanOptionalAction, default=True,
                       help="resident sessions that decode at once share one forward per token (torch, models "
                       "without recurrent or kv-shared layers); a row's logits then equal its own decode's to "
                       "float rounding, not bit for bit: --no-batch-decode decodes each session alone")
    sessions.add_argument("--session-lease", type=float, default=30.0, metavar="S",
                       help="with contextd on an object store that several servers share: how long a turn holds "
                       "its session before another server may take it over (renewed every S/3 s while the turn "
                       "runs; docs/deployment.md)")
    policy.add_argument("--selector", default="hybrid", choices=list(SELECTORS),
                       help="who advises which pages come back (default: hybrid: rare token ids and byte "
                       "n-grams, coverage, neighbours; attention: the model's own keys; see docs/controller.md)")
    policy.add_argument("--restore-pages", type=int, default=8,
                       help="hybrid and attention selectors: at most this many cold pages come back per turn "
                       "(the hybrid one stops earlier when the evidence falls off)")
    policy.add_argument("--follow-hops", type=int, default=LinkConfig.hops, metavar="N",
                       help="hybrid and rerank selectors: after the pages the question matches, follow what they "
                       f"name to the cold pages that few others share, up to N hops ({FOLLOW_HOPS} for a chain of "
                       "assignments; default 0: off, as it costs precision on other sessions; docs/controller.md)")
    model.add_argument("--chat-template", default=None, help="file with a Jinja chat template to use instead "
                       "of the model's own")
    place.add_argument("--root", default=str(default_root()), help="data folder (contextd lives under ROOT/contextd)")
    place.add_argument("--socket", default=os.environ.get("KV_ELISION_SOCKET"), help="contextd socket")
    place.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default: the API serves "
                       "the user's code, to whoever has its key)")
    place.add_argument("--api-key", default=os.environ.get("KV_ELISION_API_KEY"),
                       help="the key every route but /health wants as `Authorization: Bearer KEY` (default: "
                       f"$KV_ELISION_API_KEY; unset: the key in ROOT/{API_KEY_FILE}, made at the first start, "
                       "readable by this user only, where the Pi extension finds it; docs/server.md)")
    place.add_argument("--port", type=int, default=8088)
    place.add_argument("--drain-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="on SIGTERM or SIGINT: how long the turns running may go on before they are cut (a "
                       "decoding turn ends at its next token, written through like any cancelled turn; a second "
                       "signal cuts at once); turns not started are answered 503, and contextd stops last")
    place.add_argument("--client-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a client that stalls this long while sending its request or taking the answer is "
                       "let go (its connection closed), so stalled clients cannot hold server threads")
    place.add_argument("--stuck-after", type=float, default=STUCK_AFTER_S, metavar="SECONDS",
                       help="a step of the worker (a prefill chunk, a turn's restores, a token) running longer than "
                       "this is stuck (a read hung in the kernel): /health answers 503 and turns are refused until "
                       "it ends, so a supervisor can restart the server (docs/server.md)")
    serve.set_defaults(run=cmd_serve)
    models = sub.add_parser("models", help="list local models (Hugging Face cache, LM Studio) and whether each can "
                            "be served exactly")
    models.add_argument("--json", action="store_true", help="one JSON list instead of text")
    models.set_defaults(run=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
        return code
    except (DaemonUnavailable, BackendError, ValueError, OSError) as exc:
        print(f"kv-elision {args.verb}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
