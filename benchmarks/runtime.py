"""Our backends next to the runtimes they wrap, on the same weights: speed and memory.

    python -m benchmarks.runtime [--runtimes torch,mlx] [--prompt 2048] [--decode 256] [--repeats N] [--device cpu]
    python -m benchmarks.runtime --make-mlx-folder DIR [--model smollm2-135m] [--bits 4]

Arms, each in its own subprocess (so peak RSS is per arm), alternating ours / theirs:

- torch, ours: `load_backend("torch", ...)` prefill of a `--prompt`-token real-text prompt in one
  chunk, then `--decode` greedy tokens, each fed back (`decode()`); theirs: transformers'
  `model.generate` on the same model (same loader, dtype and SDPA attention), greedy, EOS disabled,
  timed by a streamer: prefill = until the first new token, decode = the tokens after it.
- mlx, ours: `load_backend("mlx", ...)` the same way, but with the calls mlx-lm's generate makes:
  `extend` over all but the prompt's last token (the caches only), then `prefill` of that token
  alone (the server's turn does the same: its messages `extend`, the answer's opening `prefill`);
  theirs: mlx-lm's `load` + `stream_generate` (prefill step = the prompt, EOS disabled), timed by
  when its responses arrive, the same split.

Models: SmolLM2-135M (the GGUF for torch, its 4-bit mlx-lm folder `smollm2-135m-q4` for MLX, made
by mlx_lm.convert on first use) and a tiny hybrid (Qwen3-Next: 3 Gated DeltaNet layers + 1 gated
attention layer; its 4-bit MLX copy for MLX). Speeds are tokens per second of wall time; peak RSS
is the arm's `ru_maxrss`. Per runtime the ratios are ours / theirs on SmolLM2 (the models entry has
every model's): `prefill_ratio`, `decode_ratio` (goal >= 0.9), `rss_ratio` (goal <= 1.2). Also
reported: the share of the machine's CPU other processes took meanwhile (`other_processes_cpu_share`;
above 10% `reliable` is false and a line above the JSON says so). Last line: one JSON object.

`--make-mlx-folder DIR` writes SmolLM2 (or `--model`) as an mlx-lm 4-bit folder (GGUF -> Hugging
Face folder -> `mlx_lm.convert -q`), for `kv-elision serve --backend mlx --model DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import print_result
from harness.procfs import machine_cpu_seconds, other_cpu_share

MODELS = {
    "torch": {"smollm2-135m": "smollm2-135m", "tiny-qwen3-next": "tiny-qwen3-next"},
    "mlx": {"smollm2-135m": "smollm2-135m-q4", "tiny-qwen3-next": "tiny-qwen3-next-q4"},
}
HEADLINE = "smollm2-135m"
# Per model, unless --repeats / --threads say otherwise: runs per arm (the fastest counts) and torch
# intra-op threads of its torch arms (0: torch's default). A SmolLM2 arm takes minutes and runs once. A tiny model's
# arm takes seconds, and on two threads its millisecond steps measure thread wake-ups more than code:
# quiet runs one after another put the torch tiny hybrid's decode ratio anywhere from 0.82 to 1.27
# with the best of three, and at 0.88-0.92 with the best of five; on one thread, 1.09 (2026-12-06).
ARM_DEFAULTS = {"smollm2-135m": (1, 0), "tiny-qwen3-next": (5, 1)}
WARMUP = 16  # prompt tokens of the untimed warm-up run every arm does first


def _prompt(model: str, n: int) -> list[int]:
    from backends.models import load_tokenizer, resolve
    from harness.corpus import sample_tokens

    return sample_tokens(load_tokenizer(resolve(model)), n)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _ours(runtime: str, model: str, prompt: list[int], decode: int, device: str) -> dict[str, Any]:
    from backends import load_backend
    from serving.paging import rewind

    t0 = time.perf_counter()
    be = load_backend(runtime, model, device=device, dtype="float32" if runtime == "torch" else "auto",
                      capacity=len(prompt) + decode + 8, prefill_chunk=len(prompt))
    load_s = time.perf_counter() - t0
    # Both arms warm up the same way before anything is timed, then start from an empty cache. Not
    # on a fork: a fork copies the slot buffers the capacity preallocates (SmolLM2 float32 at 2,312
    # slots: 160 MB), which the peak RSS would count against a runtime whose warm-up cache is new.
    # Emptied through serving.paging, where pages move (its import adds ~12 MB to ours).
    be.prefill(prompt[:WARMUP])
    for _ in range(3):
        be.decode()
    rewind(be, 0)
    be.synchronize()
    t0 = time.perf_counter()
    if runtime == "mlx":   # mlx-lm: the caches over all but the last token, then that token alone
        be.extend(prompt[:-1])
        be.prefill(prompt[-1:])
    else:                  # transformers: the prompt in one forward
        be.prefill(prompt)
    be.decode()  # the first new token, picked from the prefill's logits
    be.synchronize()
    t1 = time.perf_counter()
    for _ in range(decode):
        be.decode()
    be.synchronize()
    t2 = time.perf_counter()
    return {"prefill_tps": len(prompt) / (t1 - t0), "decode_tps": decode / (t2 - t1), "load_s": load_s}


def _torch_theirs(model: str, prompt: list[int], decode: int, device: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from backends.models import SourceKind, resolve
    from backends.torch import unpacked_gguf

    source = resolve(model)
    # The files ours loads: for a GGUF, the float32 folder both load from (backends.torch.gguf), so the
    # arms differ in the runtime, not in a GGUF parse and dequantization only one of them pays.
    folder = unpacked_gguf(source) if source.kind is SourceKind.GGUF else source.path
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval().to(device)
    load_s = time.perf_counter() - t0
    hf.generation_config.eos_token_id = None
    stamps: list[float] = []

    class Clock(BaseStreamer):  # type: ignore[misc]
        def put(self, value: Any) -> None:
            stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        warm = ids[:, :WARMUP]
        hf.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=0)
        stamps.clear()
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=decode + 1,
                    do_sample=False, streamer=Clock(), pad_token_id=0)
    # put() gets the prompt first, then each new token: stamps[1] is the first new token.
    assert len(stamps) == decode + 2, len(stamps)
    return {"prefill_tps": len(prompt) / (stamps[1] - t0), "decode_tps": decode / (stamps[-1] - stamps[1]),
            "load_s": load_s}


def _mlx_theirs(model: str, prompt: list[int], decode: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    from backends.mlx import quantized_copy
    from backends.models import SourceKind, resolve

    source = resolve(model)
    folder = quantized_copy(source) if source.kind is SourceKind.MLX_QUANT else source.path
    t0 = time.perf_counter()
    hf_model, tokenizer = load(str(folder))
    load_s = time.perf_counter() - t0
    tokenizer.eos_token_ids = set()
    for _ in stream_generate(hf_model, tokenizer, mx.array(prompt[:WARMUP]), max_tokens=4):
        pass
    stamps: list[float] = []
    t0 = time.perf_counter()
    for _ in stream_generate(hf_model, tokenizer, mx.array(prompt), max_tokens=decode + 1,
                             prefill_step_size=len(prompt)):
        stamps.append(time.perf_counter())
    assert len(stamps) == decode + 1, len(stamps)
    return {"prefill_tps": len(prompt) / (stamps[0] - t0), "decode_tps": decode / (stamps[-1] - stamps[0]),
            "load_s": load_s}


def prepare(runtime: str, name: str) -> None:
    """Build what the arms read (tiny folders, MLX-quantized copies, the tokenizer folder) before
    any arm runs, so no arm's time or peak memory includes a one-time build."""
    from backends.models import SourceKind, load_tokenizer, resolve

    source = resolve(MODELS[runtime][name])
    load_tokenizer(source)
    if source.kind is SourceKind.MLX_QUANT:
        from backends.mlx import quantized_copy

        quantized_copy(source)


def run_arm(arm: str, prompt_tokens: int, decode: int, device: str) -> dict[str, Any]:
    runtime, who, name = arm.split(":", 2)
    if who == "prepare":
        prepare(runtime, name)
        return {}
    model = MODELS[runtime][name]
    prompt = _prompt(model, prompt_tokens)
    if who == "ours":
        out = _ours(runtime, model, prompt, decode, device)
    elif runtime == "torch":
        out = _torch_theirs(model, prompt, decode, device)
    else:
        out = _mlx_theirs(model, prompt, decode)
    out["peak_rss_mb"] = _peak_rss_mb()
    return {k: round(v, 2) for k, v in out.items()}


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    return {"prefill_ratio": round(ours["prefill_tps"] / theirs["prefill_tps"], 3),
            "decode_ratio": round(ours["decode_tps"] / theirs["decode_tps"], 3),
            "rss_ratio": round(ours["peak_rss_mb"] / theirs["peak_rss_mb"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtimes", default="torch,mlx")
    parser.add_argument("--models", default=",".join(MODELS["torch"]))
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=256)
    parser.add_argument("--device", default="cpu", help="torch arms: cpu or cuda (MLX picks its own)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="runs per arm, the fastest counts (0: the model's default, ARM_DEFAULTS)")
    parser.add_argument("--threads", type=int, default=-1, help="torch intra-op threads in every arm (0: torch's "
                        "default, -1: the model's, ARM_DEFAULTS); on a busy shared machine 1 avoids measuring "
                        "waits for descheduled threads")
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--make-mlx-folder", type=Path, help="write --model as an mlx-lm folder there and exit")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bits", type=int, default=4)
    args = parser.parse_args(argv)

    if args.make_mlx_folder:
        from backends.mlx import make_mlx_folder

        out = make_mlx_folder(args.model, args.make_mlx_folder.resolve(), bits=args.bits)
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        print(json.dumps({"folder": str(out), "weights_mb": round(size / 1e6, 1)}))
        return 0
    if args.arm:
        if args.threads > 0:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(run_arm(args.arm, args.prompt, args.decode, args.device)))
        return 0

    machine0 = machine_cpu_seconds()
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    result: dict[str, Any] = {"prompt_tokens": args.prompt, "decode_tokens": args.decode, "device": args.device}
    for runtime in args.runtimes.split(","):
        per_model: dict[str, Any] = {}
        for name in args.models.split(","):
            arms: dict[str, list[dict[str, Any]]] = {"ours": [], "theirs": []}
            subprocess.run([sys.executable, "-m", "benchmarks.runtime", "--arm", f"{runtime}:prepare:{name}"],
                           check=True, capture_output=True, env=os.environ.copy())
            repeats, threads = ARM_DEFAULTS[name]
            repeats = args.repeats or repeats
            if args.threads >= 0:
                threads = args.threads
            elif runtime != "torch":
                threads = 0   # the default is torch's threads: an MLX arm would import torch only to set them
            for _ in range(repeats):
                for who in ("ours", "theirs"):
                    cmd = [sys.executable, "-m", "benchmarks.runtime", "--arm", f"{runtime}:{who}:{name}",
                           "--prompt", str(args.prompt), "--decode", str(args.decode), "--threads", str(threads),
                           "--device", args.device]
                    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
                    if done.returncode != 0:
                        raise SystemExit(f"arm {runtime}:{who}:{name} failed:\n{done.stderr[-3000:]}")
                    arms[who].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(f"{runtime} {name} {who}: {arms[who][-1]}", file=sys.stderr, flush=True)
            best = {who: {"prefill_tps": max(r["prefill_tps"] for r in runs),
                          "decode_tps": max(r["decode_tps"] for r in runs),
                          "peak_rss_mb": min(r["peak_rss_mb"] for r in runs),
                          "load_s": min(r["load_s"] for r in runs)} for who, runs in arms.items()}
            per_model[name] = {**best, **_ratios(best["ours"], best["theirs"]), "model": MODELS[runtime][name],
                               "repeats": repeats, "torch_threads": threads or "default"}
        headline = per_model.get(HEADLINE) or next(iter(per_model.values()))
        result[runtime] = {k: headline[k] for k in ("prefill_ratio", "decode_ratio", "rss_ratio")}
        result[runtime]["models"] = per_model
    machine1 = machine_cpu_seconds()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    other = other_cpu_share(machine0, machine1, ours)
    print_result(result, other)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
