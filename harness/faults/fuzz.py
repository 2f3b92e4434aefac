"""Fuzzing: Hypothesis-generated malformed HTTP requests (bodies, headers, X-KV-Context pieces,
chunked encodings, slow clients, invalid UTF-8, deep and huge JSON) to a real server, malformed
gRPC requests and raw bytes to a real contextd; what each answered, and what was not a clear 4xx
(gRPC: a status other than INTERNAL / UNKNOWN).

Depends on hypothesis, grpc and contextd's client side.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

CHAT = "/v1/chat/completions"

ACCEPTABLE_HTTP = set(range(200, 300)) | set(range(400, 500)) | {501, 505}  # 501/505: unknown method, bad version


def http_strategies(auth: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Kinds of malformed (now and then well-formed) HTTP requests, each a strategy for raw bytes.
    Each request that has headers of its own carries `auth` (the server's Authorization header),
    so that the fuzzing reaches the routes and not only the 401 that a request without the key
    gets; a request whose fuzzed headers name Authorization themselves carries only those."""
    from hypothesis import strategies as st

    credentials = [(name.encode(), value.encode()) for name, value in (auth or {}).items()]

    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                          st.text(max_size=40))
    json_any = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                               st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                            max_leaves=12)
    role = st.sampled_from(["user", "assistant", "system", "tool", "developer", "function", "", "USER", "x" * 300])
    content = st.one_of(st.text(max_size=60), json_any,
                        st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x", ""])},
                                                       optional={"text": json_any, "image_url": json_any}), max_size=3))
    message = st.fixed_dictionaries({}, optional={
        "role": role, "content": content, "name": json_any, "tool_call_id": json_any,
        "tool_calls": st.one_of(json_any, st.lists(st.fixed_dictionaries(
            {}, optional={"id": json_any, "type": json_any, "function": st.one_of(json_any, st.fixed_dictionaries(
                {}, optional={"name": json_any, "arguments": json_any}))}), max_size=2))})
    body = st.fixed_dictionaries({}, optional={
        "model": st.one_of(st.just("tiny-llama"), json_any),
        "messages": st.one_of(st.lists(message, max_size=4), json_any),
        "tools": st.one_of(json_any, st.lists(st.dictionaries(st.sampled_from(["type", "function"]), json_any,
                                                              max_size=2), max_size=2)),
        "max_tokens": st.one_of(st.integers(-5, 2), json_any), "temperature": json_any, "seed": json_any,
        "stream": json_any, "stream_options": json_any, "reasoning_effort": json_any, "thinking": json_any,
        "max_completion_tokens": st.one_of(st.just(1), json_any)})

    def encode(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")

    def request(path: bytes, headers: list[tuple[bytes, bytes]], payload: bytes | None, method: bytes = b"POST",
                length: bytes | None = None, version: bytes = b"HTTP/1.1") -> bytes:
        lines = [method + b" " + path + b" " + version, b"Host: 127.0.0.1", b"Connection: close"]
        if payload is not None:
            lines.append(b"Content-Length: " + (length if length is not None else str(len(payload)).encode()))
        named = {name.lower() for name, _ in headers}
        lines += [name + b": " + value for name, value in credentials if name.lower() not in named]
        lines += [name + b": " + value for name, value in headers]
        return b"\r\n".join(lines) + b"\r\n\r\n" + (payload or b"")

    header_value = st.one_of(st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
                             st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")
                                                      .replace(b"\r", b"").replace(b"\n", b"")))
    context_piece = st.one_of(st.text(max_size=80), json_any.map(lambda x: json.dumps(x)),
                              st.builds(lambda m, t: json.dumps({"v": 1, "messages": m, "thinking": t}),
                                        st.lists(json_any, max_size=5), json_any))
    context_headers = st.lists(context_piece, min_size=1, max_size=6).flatmap(
        lambda pieces: st.permutations(list(range(len(pieces)))).map(lambda order: [
            ((b"X-KV-Context" if n == 0 else b"X-KV-Context-%d" % (n + 1)),
             pieces[k].encode("utf-8", "surrogatepass").replace(b"\r", b"").replace(b"\n", b""))
            for n, k in enumerate(order)]))
    valid_ish = st.builds(lambda b: encode(b), body)

    kinds = {
        "json body": st.builds(lambda b: request(CHAT.encode(), [], b), valid_ish),
        "binary body": st.builds(lambda b: request(CHAT.encode(), [], b), st.binary(max_size=300)),
        "invalid utf-8": st.builds(lambda b, cut: request(CHAT.encode(), [], b[:cut] + b"\xff\xfe\xc3" + b[cut:]),
                                   valid_ish, st.integers(0, 40)),
        "truncated json": st.builds(lambda b, cut: request(CHAT.encode(), [], b[:max(1, len(b) * cut // 100)]),
                                    valid_ish, st.integers(1, 99)),
        "deep json": st.builds(lambda d, c: request(CHAT.encode(), [], (c[0] * d + c[1] * d).encode()),
                               st.integers(200, 120_000), st.sampled_from([("[", "]"), ('{"a":', "}")])),
        "huge json": st.builds(lambda n: request(CHAT.encode(), [], encode({"model": "tiny-llama", "messages": [
            {"role": "user", "content": "x" * n}], "max_tokens": 0})), st.integers(1 << 16, 3 << 20)),
        "declared too large": st.builds(lambda n: request(CHAT.encode(), [], b"{}", length=str(n).encode()),
                                        st.integers((32 << 20) + 1, 1 << 62)),
        "bad content-length": st.builds(lambda v, b: request(CHAT.encode(), [], b, length=v),
                                        st.sampled_from([b"-1", b"abc", b"1e3", b"0x10", b"", b" 5", b"5, 5"]),
                                        st.binary(max_size=20)),
        "headers": st.builds(lambda hs, b: request(CHAT.encode(), hs, b),
                             st.lists(st.tuples(st.sampled_from([b"X-KV-Session", b"X-Session-Affinity", b"Accept",
                                                                 b"Content-Type", b"X-KV-Context", b"Authorization",
                                                                 b"X-KV-Context-2", b"Expect"]), header_value),
                                      max_size=5), valid_ish),
        "x-kv-context": st.builds(lambda hs, b: request(CHAT.encode(), hs, b), context_headers, valid_ish),
        "long header": st.builds(lambda n: request(CHAT.encode(), [(b"X-KV-Context", b"a" * n)], b"{}"),
                                 st.integers(60_000, 200_000)),
        "chunked": st.builds(lambda chunks, b: request(CHAT.encode(), [(b"Transfer-Encoding", b"chunked")], None)
                             + b"".join(b"%x\r\n" % len(c) + c + b"\r\n" for c in chunks) + b"0\r\n\r\n",
                             st.lists(st.binary(min_size=1, max_size=30), max_size=4), valid_ish),
        "bad chunked": st.builds(lambda junk: request(CHAT.encode(), [(b"Transfer-Encoding", b"chunked")], None) + junk,
                                 st.binary(max_size=60)),
        "request line": st.builds(lambda m, path, v: request(path, [], b"{}", method=m, version=v),
                                  st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"HEAD", b"FOO",
                                                   b"P\xffST"]),
                                  st.one_of(st.sampled_from([b"/v1/chat/completions", b"/v1/models", b"/health",
                                                             b"/v1/kv/stats?session=%00", b"/v1/kv/stats?session=",
                                                             b"http://x/health", b"*", b"/" + b"a" * 70_000]),
                                            st.binary(max_size=40).map(lambda b: b"/" + b.replace(b" ", b"")
                                                                       .replace(b"\r", b"").replace(b"\n", b""))),
                                  st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/x", b""])),
        "garbage": st.binary(min_size=1, max_size=200).map(lambda b: b + b"\r\n\r\n"),
    }
    return kinds


HTTP_WEIGHTS = {"json body": 6, "binary body": 2, "invalid utf-8": 2, "truncated json": 2, "deep json": 1,
                "huge json": 0.5, "declared too large": 0.5, "bad content-length": 1, "headers": 2, "x-kv-context": 3,
                "long header": 0.5, "chunked": 1, "bad chunked": 1, "request line": 2, "garbage": 2}

# Kinds whose framing is broken on purpose (the server cannot know where the request ends): the
# client closes its sending side after the request, so a server that waits for more reads EOF.
# Every other request is framed right and the client keeps its side open, as a real client does:
# the server takes a half-closed connection for a client that left (a queued turn is dropped, a
# running one ends), which would hide what the turn itself answers.
HALF_CLOSE_KINDS = {"bad content-length", "chunked", "bad chunked", "request line", "garbage", "long header",
                    "declared too large"}


def http_exchange(port: int, raw: bytes, timeout: float = 20.0, half_close: bool = False
                  ) -> tuple[int | None, bytes]:
    """Send one raw request (then, with `half_close`, shut the sending side); (status, body) of
    the answer, (None, b"") when the server closed the connection without one, (-1, b"") when it
    did not answer in time."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        try:
            conn.sendall(raw)
            if half_close:
                conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer (413, 400) and close before reading everything
        data = b""
        try:
            while True:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            return -1, data
        except OSError:
            pass
    if not data.startswith(b"HTTP/"):
        return None, data
    try:
        return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[-1]
    except (IndexError, ValueError):
        return None, data


@dataclass
class FuzzTally:
    sent: int = 0
    answered: dict[str, int] = field(default_factory=dict)
    unclear: dict[str, list[str]] = field(default_factory=dict)

    def note(self, kind: str, outcome: str, ok: bool, example: str = "") -> None:
        self.sent += 1
        self.answered[outcome] = self.answered.get(outcome, 0) + 1
        if not ok:
            found = self.unclear.setdefault(f"{kind}: {outcome}", [])
            if len(found) < 3:
                found.append(example[:160])

    @property
    def unclear_count(self) -> int:
        return sum(v for k, v in self.answered.items() if k.startswith("UNCLEAR"))


def _bound(fn: Callable[[str, Any], None], kind: str) -> Callable[[Any], None]:
    """A one-argument test for Hypothesis's @given (which refuses defaults and partials)."""
    def run(value: Any) -> None:
        fn(kind, value)
    return run


def _examples(test: Callable[[Any], None], strategy: SearchStrategy[Any], count: int, seed: int) -> None:
    """`test` on `count` examples drawn from `strategy`, reproducibly from `seed`: generated only
    (no shrinking, no example database, no deadline, no health checks)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    run: Callable[[], None] = given(strategy)(test)
    run = settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
                   suppress_health_check=list(HealthCheck))(run)
    hseed(seed)(run)()


def fuzz_http(port: int, n: int, seed: int = 0, alive: Callable[[], bool] | None = None,
              auth: Mapping[str, str] | None = None) -> FuzzTally:
    """About `n` Hypothesis-generated requests against the server on `port`, every kind in
    proportion, each with `auth` (ServerProcess.auth_headers: a server wants its key on every
    route but /health, and a request without it is answered 401 before anything is parsed)."""

    tally = FuzzTally()
    kinds = http_strategies(auth)
    total = sum(HTTP_WEIGHTS.values())
    for k, (kind, strategy) in enumerate(kinds.items()):
        count = max(1, round(n * HTTP_WEIGHTS[kind] / total))

        def one(kind: str, raw: bytes) -> None:
            status, body = http_exchange(port, raw, half_close=kind in HALF_CLOSE_KINDS)
            if status is None:
                # nothing came back: fine for a request that never ended its headers, for an HTTP/0.9
                # answer (one word on the request line: no status line, by that protocol) and for an
                # empty first line (http.server reads no request from it: LF alone ends a line)
                ok = b"\r\n\r\n" not in raw[:70_000] or bool(body) or not raw.split(b"\n", 1)[0].strip()
                tally.note(kind, "closed (no request / HTTP/0.9)" if ok else "UNCLEAR: closed without an answer", ok,
                           repr(raw[:120]))
            elif status == -1:
                tally.note(kind, "UNCLEAR: no answer in time", False, repr(raw[:120]))
            else:
                clear = status in ACCEPTABLE_HTTP and (status < 400 or status >= 500 or body[:1] in (b"{", b"<", b""))
                tally.note(kind, f"{status}" if clear else f"UNCLEAR: {status}", clear,
                           body[:160].decode(errors="replace"))
            if alive is not None and tally.sent % 500 == 0 and not alive():
                raise RuntimeError(f"the server stopped answering after {tally.sent} fuzz requests")

        _examples(_bound(one, kind), strategy, count, seed + k)
    return tally


SLOW_CLIENT_TIMEOUT_S = 2.0   # the fuzzed server's --client-timeout: short, so the check waits past it
SLOW_CLIENT_SLACK_S = 10.0    # past it, for a busy machine, before a client still held counts as held


def slow_clients(port: int, clients: int = 40, auth: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Clients that open a connection, send half a request (half of them its headers whole and
    with the key, then part of the body; the others part of a header line) and wait: does the
    server still answer others, and does it let go of each (an answer, 408, or the connection
    closed) once its --client-timeout has passed? Each is waited for until SLOW_CLIENT_TIMEOUT_S
    plus slack after they all began."""
    key = "".join(f"{name}: {value}\r\n" for name, value in (auth or {}).items()).encode()
    conns = []
    for n in range(clients):
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n" + key + b"Content-Length: 100\r\n\r\n{\"mess" if n % 2
                     else b"POST /v1/chat/completions HTTP/1.1\r\nX-KV-Sess")
        conns.append(conn)
    started = time.monotonic()
    status, _ = http_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=10)
    health_ms = (time.monotonic() - started) * 1e3
    deadline = started + SLOW_CLIENT_TIMEOUT_S + SLOW_CLIENT_SLACK_S
    dropped = 0
    let_go_s = 0.0
    for conn in conns:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            conn.recv(1)   # an answer (408) or the end of the stream: let go either way
            dropped += 1
        except TimeoutError:
            pass
        except OSError:
            dropped += 1
        let_go_s = max(let_go_s, time.monotonic() - started)
        conn.close()
    return {"slow_clients": clients, "health_while_slow": status, "health_ms": round(health_ms, 1),
            "slow_clients_let_go": dropped, "slow_clients_let_go_s": round(let_go_s, 1)}


def grpc_strategies() -> Any:
    """(method, request message) for every unary contextd verb, fields filled adversarially."""
    from google.protobuf import message_factory
    from google.protobuf.descriptor import FieldDescriptor as F
    from hypothesis import strategies as st

    from contextd.client import pb

    service = pb.DESCRIPTOR.services_by_name["Contextd"]
    ids = st.one_of(st.sampled_from(["s1", "s2", "p0000001", "p0000002.5", "s1/p", "../../etc", ".hidden", "",
                                     "a" * 129,
                                     "a:b", "x\x00y", "é", "s1\n"]), st.text(max_size=20))
    scalar = {F.TYPE_STRING: st.one_of(ids, st.text(max_size=200), st.just("x" * 70_000)),
              F.TYPE_BYTES: st.binary(max_size=50),
              F.TYPE_BOOL: st.booleans(),
              F.TYPE_DOUBLE: st.floats(), F.TYPE_FLOAT: st.floats(width=32),
              F.TYPE_INT32: st.integers(-2**31, 2**31 - 1), F.TYPE_INT64: st.integers(-2**63, 2**63 - 1),
              F.TYPE_UINT32: st.integers(0, 2**32 - 1), F.TYPE_UINT64: st.one_of(st.integers(0, 300),
                                                                                st.integers(0, 2**64 - 1)),
              F.TYPE_ENUM: st.integers(0, 7)}

    def message(descriptor: Any, depth: int) -> Any:
        fields = {}
        for f in descriptor.fields:
            if f.type == F.TYPE_MESSAGE:
                if f.message_type.GetOptions().map_entry:
                    value: Any = st.dictionaries(st.text(max_size=10),
                                                 st.one_of(st.text(max_size=10), st.integers(0, 9)), max_size=3)
                elif depth > 2:
                    continue
                else:
                    value = message(f.message_type, depth + 1)
                    if _repeated(f):
                        value = st.lists(value, max_size=4)
            else:
                value = scalar.get(f.type, st.none())
                if _repeated(f):
                    value = st.lists(value, max_size=5)
            fields[f.name] = value

        def build(values: dict[str, Any]) -> Any:
            msg = message_factory.GetMessageClass(descriptor)()
            for name, value in values.items():
                field_ = descriptor.fields_by_name[name]
                try:
                    if field_.type == F.TYPE_MESSAGE and field_.message_type.GetOptions().map_entry:
                        target = getattr(msg, name)
                        for k, v in value.items():
                            try:
                                target[k] = v
                            except (TypeError, ValueError):
                                pass
                    elif field_.type == F.TYPE_MESSAGE and _repeated(field_):
                        getattr(msg, name).extend(value)
                    elif field_.type == F.TYPE_MESSAGE:
                        getattr(msg, name).CopyFrom(value)
                    elif _repeated(field_):
                        getattr(msg, name).extend(value)
                    else:
                        setattr(msg, name, value)
                except (TypeError, ValueError):
                    pass
            return msg

        return st.fixed_dictionaries({}, optional=fields).map(build)

    methods = [m for m in service.methods if not m.server_streaming]
    return st.sampled_from(methods).flatmap(lambda m: message(m.input_type, 0).map(lambda msg: (m.name, msg)))


def _repeated(field_: Any) -> bool:
    flag = getattr(field_, "is_repeated", None)
    return bool(flag) if flag is not None else bool(field_.label == field_.LABEL_REPEATED)


CLEAR_GRPC = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "ALREADY_EXISTS",
              "DATA_LOSS", "OUT_OF_RANGE", "UNIMPLEMENTED"}


def fuzz_grpc(socket_path: Path, n: int, seed: int = 0) -> FuzzTally:
    """`n` gRPC calls and raw writes to contextd: adversarial messages through the typed stub,
    undecodable bodies through a raw method, and bytes that are not HTTP/2 at all."""
    import grpc
    from hypothesis import strategies as st

    from contextd.paths import target
    from contextd.wire import grpc_options

    channel = grpc.insecure_channel(target(socket_path), options=grpc_options())
    tally = FuzzTally()
    prefix = "/kv_elision.contextd.v1.Contextd/"
    structured = grpc_strategies()
    undecodable = st.tuples(st.sampled_from(["UpsertPages", "WriteRecord", "SetPageStates", "Status", "GetPages",
                                             "Nope"]),
                            st.binary(max_size=300))
    raw_bytes = st.one_of(st.binary(min_size=1, max_size=400),
                          st.binary(max_size=200).map(lambda b: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b),
                          st.binary(max_size=200).map(lambda b: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                                                      + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b))
    def one(kind: str, what: Any) -> None:
        if kind == "raw":
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(2.0)
                    conn.connect(str(socket_path))
                    conn.sendall(what)
                    with contextlib.suppress(OSError):
                        conn.recv(1 << 12)
                tally.note("raw", "connection handled", True)
            except OSError as exc:
                tally.note("raw", f"UNCLEAR: {type(exc).__name__}", False, str(exc))
            return
        if kind == "call":
            method, request = what
            call = channel.unary_unary(prefix + method, request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=lambda b: b)
        else:
            method, request = what
            call = channel.unary_unary(prefix + method, request_serializer=None, response_deserializer=None)
        try:
            call(request, timeout=20.0)
            tally.note(kind, "OK", True)
        except grpc.RpcError as exc:
            code = exc.code().name
            detail = exc.details() or ""
            ok = code in CLEAR_GRPC
            label = code if ok else f"UNCLEAR: {code}" + (" (undecodable body)" if "deserializ" in detail else "")
            tally.note(f"{kind} {method}", label, ok, detail)

    try:
        for k, (kind, strategy, share) in enumerate([("call", structured, 0.7), ("bytes", undecodable, 0.15),
                                                      ("raw", raw_bytes, 0.15)]):
            _examples(_bound(one, kind), strategy, max(1, round(n * share)), seed + k)
    finally:
        channel.close()
    return tally
