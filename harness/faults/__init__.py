"""The reliability campaign's machinery, driven by tests/reliability and `python -m benchmarks.faults`.

Every check compares against an oracle, never against "it did not crash". Turns run on the tiny
random-weight models in children forked from a zygote that loaded them once (`zygote`, `driver`);
the oracle is an uncrashed twin fed the same completed requests (`oracle`). The parts: `crash`
(kill -9 at named crash points), `storage` (refused writes and damaged payloads; the statuses come
from serving.http_request.ERROR_STATUS), `fuzz` (malformed HTTP and gRPC), `connections` (hostile
Content-Length, slowloris, a client that stops reading), `sessions` (interleaved sessions,
contextd restarts under a live server), `access` (modes, loopback, the API key, another uid on
every route), `hangs` (a read wedged in the kernel, the MLX finalizer on a reader thread) and
`objects` (a lost reply on every conditional PUT of the object-store tier, cache pressure; a real
Ceph RGW, with `network`'s proxy). `processes` starts the campaign's contextd and sets the
environment its processes inherit; `scenarios` holds the sessions. Every process a run starts is
ended by its pid.

Depends on serving, contextd, backends, harness.procfs, harness.rgw and (fuzz) hypothesis.
"""
