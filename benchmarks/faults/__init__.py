"""The reliability campaign (issue 15): crashes, storage faults, fuzzing, connections, concurrency,
access, hangs and the object-store tier.

    python -m benchmarks.faults                    # the whole campaign (slow: ~20-40 min on 2 cores)
    python -m benchmarks.faults --parts crash --crash-points 40    # a part, smaller
    python -m benchmarks.faults --json-out bench-out/faults.json

It prints a summary table, then one JSON line (the figures docs/reliability.md quotes). Every
check compares against an oracle, never against "it did not crash":

  crash    kill -9 at named crash points (contextd.crashpoints) in the serving code (chunked
           prefill, payload written but not recorded, eviction, decode, write-through, recovery)
           and in contextd (before and after a commit is durable). After each restart the oracle
           is an uncrashed twin fed the same turns: the requests whose record was committed, in
           order (a turn that died is re-sent by the client; one that died after its record is a
           retry). Checked: every acknowledged turn and page present and verifying, no manifest row
           pointing at a missing or partial file, the manifest after recovery equal to the twin's
           (ids, states, checksums), the accounting invariant, the held tokens equal to the
           session's own resident pages, and every later answer equal to the twin's.
  storage  torn, flipped, truncated, missing, emptied payloads and snapshots; ENOSPC, EDQUOT, EIO
           and EROFS from open / write / fsync / rename / directory fsync (fault injection at the
           file-I/O seam, contextd/blobs.py) and, where mounting is allowed, a real full and a real
           read-only tmpfs. Checked: the client gets an error (507 / 503) or a correct answer, a
           corrupt byte never reaches attention, the manifest never points at a missing file, and
           once the fault is gone the session goes on exactly as its twin.
  fuzz     Hypothesis-generated malformed HTTP requests (bodies, headers, X-KV-Context pieces,
           chunked encodings, slow clients, invalid UTF-8, deep and huge JSON) to a real server,
           malformed gRPC requests and raw bytes to a real contextd. Checked: a clear 4xx (gRPC: a
           status other than INTERNAL / UNKNOWN), both processes keep serving, memory bounded.
  connections  hostile Content-Length values (refused before the client timeout), slowloris
           clients trickling headers or body (let go at --client-timeout, /health answering
           meanwhile), a client that stops reading its stream (its turn ended, the next served).
  sessions 4 clients, 4 sessions, one server, interleaved: each session's answers equal its solo
           twin's, no forward pass on a switch, no page of one session in another's attention;
           contextd killed and restarted under a live server.
  access   socket and store modes, loopback binding, the API key; another uid (`nobody`, as
           root) trying every route of a server on its default key: every one but /health denied.
  hangs    a read wedged in the kernel on a read queue's thread and on the worker's own (the
           turn 503 within its deadline, /health 503 while stuck, the server as its twin once the
           read returns); the MLX greedy-step finalizer run on a restore's reader thread.
  objects  on a Ceph RGW the part starts (root and Debian's ceph packages; skipped, saying why,
           without them): a lost reply on every conditional PUT of the object-store tier, each
           case against the script with none lost (stuck: a call that differs, fails or waits);
           cache pressure (a store folder smaller than a page) while sessions are streamed back,
           no page reported corrupt, the answers those of a server on local disk.

Turns run on the tiny random-weight models. The serving engine runs in-process in children forked
from a "zygote" that loaded the models once (a fork costs milliseconds; loading a model ~10 s),
so hundreds of kill -9 restarts fit in minutes; every process a run starts (zygote, contextd,
servers) is ended by pid.

The machinery (the zygote, the driver, the twins, each part's cases and checks) is harness.faults,
which tests/reliability drives too; this package runs the parts at campaign size and reports: one
module per part (`crash`, `storage`, `fuzz`, `connections`, `sessions`, `access`, `hangs`,
`objects`), the summary table (`report`) and the command line (`__main__`). Depends on
harness.faults, benchmarks.stats and serving.
"""
