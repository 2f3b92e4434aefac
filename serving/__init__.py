"""Serving: the engine (one turn), the page mover (the only place pages move), the transcript,
the OpenAI-compatible HTTP server, the `kv-elision` CLI and the process launcher.

Dependency rules: the only package that imports the other three (backends, controller,
contextd.client); nothing imports serving but benchmarks and tests (tests/unit/test_layers.py).
"""
