"""The reliability campaign's machinery, driven by tests/reliability and `python -m benchmarks.faults`.

Every check compares against an oracle, never against "it did not crash". Turns run on the tiny
random-weight models in children forked from a zygote that loaded them once (`zygote`, `driver`);
the oracle is an uncrashed twin fed the same completed requests (`oracle`). The parts: `crash`
(kill -9 at named crash points), `storage` (refused writes and damaged payloads; the statuses come
from serving.http.ERROR_STATUS), `fuzz` (malformed HTTP and gRPC), `sessions` (interleaved
sessions, contextd restarts under a live server) and `access` (modes, loopback, the API key).
`processes` starts the campaign's contextd and sets the environment its processes inherit;
`scenarios` holds the sessions. Every process a run starts is ended by its pid.

Depends on serving, contextd, backends, harness.procfs and (fuzz) hypothesis.
"""
