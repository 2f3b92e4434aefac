"""Network faults on the path to an object store: a loopback HTTP proxy in front of a real S3
endpoint (Ceph RGW, harness/rgw.py) that forwards every byte as it is, and that can, once each,
lose the reply to a chosen request after the store has applied it, or hold a chosen request back
until the test lets it go.

`StallingProxy` is a plain TCP path to the store that can stop forwarding while every connection
stays open (a stalled path, not a refused one), and that can cap its rate so that a transfer lasts
long enough to kill the store in its middle.

A lost reply is what a connection reset after the store's commit looks like to a client: the
write happened, the client cannot know it, and it sends the write again. A held request is a slow
path at a chosen moment: another client's request goes through meanwhile, which is how a race
between two servers is played in a fixed order, without sleeping.

Requests are told apart by their request line (method and path: the bucket and the object's key);
their bodies are skipped by Content-Length, never parsed. Every wait has a deadline (WAIT_S).

Depends on the standard library only.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Fault", "S3Proxy", "StallingProxy"]

WAIT_S = 60.0   # the longest a held request waits for its release, and a test for a fault to be reached
_HEAD_END = b"\r\n\r\n"


@dataclass
class Fault:
    """One fault, armed until the first request of `method` (one, or several joined by "|") whose
    path holds `fragment`.

    `kind` is "lose" (the reply to that request is dropped and its connection closed once the store
    has answered; `status` is the status the client never saw), "hold" (the request waits, unsent,
    until `release`) or "refuse" (every such request's connection is closed unsent, a store that
    is down for it, until `release`). `reached` is set when it first fires."""

    method: str
    fragment: str
    kind: str
    reached: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    status: int = 0

    def wait(self) -> None:
        """Until the fault has fired (TimeoutError after WAIT_S: the request never came)."""
        if not self.reached.wait(WAIT_S):
            raise TimeoutError(f"no {self.method} of a path holding {self.fragment!r} within {WAIT_S:g} s")

    def release(self) -> None:
        self.released.set()


def _connections(server: socket.socket, target: int) -> Iterator[tuple[socket.socket, socket.socket]]:
    """Each connection accepted on `server`, with a new one to the store on port `target`, until
    `server` is closed; a client that comes while the store is down is closed (so is this path)."""
    while True:
        try:
            client, _ = server.accept()
        except OSError:
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", target))
        except OSError:
            client.close()
            continue
        yield client, upstream


class _Closed(Exception):
    """A side of the connection closed."""


class _Reader:
    """Bytes from one socket, read on demand."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise _Closed
        self.buffer += chunk

    def until(self, mark: bytes) -> bytes:
        """Up to and including the next `mark`."""
        while mark not in self.buffer:
            self._more()
        end = self.buffer.index(mark) + len(mark)
        found, self.buffer = self.buffer[:end], self.buffer[end:]
        return found

    def head(self) -> bytes:
        """An HTTP head, up to and including the blank line that ends it."""
        return self.until(_HEAD_END)

    def forward(self, count: int, sink: socket.socket) -> None:
        """Pass the next `count` bytes on to `sink`."""
        while count > 0:
            if not self.buffer:
                self._more()
            piece, self.buffer = self.buffer[:count], self.buffer[count:]
            sink.sendall(piece)
            count -= len(piece)

    def chunked(self, sink: socket.socket) -> None:
        """Pass a chunked body on to `sink`, its last chunk and trailers included."""
        while True:
            size_line = self.until(b"\r\n")
            sink.sendall(size_line)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while (line := self.until(b"\r\n")) != b"\r\n":
                    sink.sendall(line)
                sink.sendall(line)
                return
            self.forward(size + 2, sink)


def _content_length(head: bytes) -> int | None:
    """The head's Content-Length (0 when it names none); None when its body is chunked."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding":
            return None
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return length


def _forward_body(reader: _Reader, head: bytes, sink: socket.socket) -> None:
    length = _content_length(head)
    if length is None:
        reader.chunked(sink)
    else:
        reader.forward(length, sink)


class _Connection:
    """One client connection and its own connection to the store. HTTP/1.1 without pipelining: a
    client sends its next request once it has read the last reply, so replies come in the order
    of `sent`."""

    def __init__(self, proxy: S3Proxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.sent: deque[tuple[str, Fault | None]] = deque()   # each request's method and its fault to lose

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def requests(self) -> None:
        """Client to store, a request at a time: its head is matched against the armed faults."""
        reader = _Reader(self.client)
        try:
            while True:
                head = reader.head()
                method, path = (part.decode() for part in head.split(b" ", 2)[:2])
                fault = self.proxy.take(method, path)
                if fault is not None and fault.kind == "refuse":
                    fault.reached.set()
                    raise _Closed
                if fault is not None and fault.kind == "hold":
                    fault.reached.set()
                    if not fault.released.wait(WAIT_S):
                        raise _Closed
                self.sent.append((method, fault if fault is not None and fault.kind == "lose" else None))
                self.upstream.sendall(head)
                _forward_body(reader, head, self.upstream)
        except (_Closed, OSError, ValueError):
            pass
        finally:
            self.close()

    def replies(self) -> None:
        """Store to client. The final reply to a request whose reply is to be lost is dropped and
        both connections closed; an interim 100 Continue still goes through (the request's body
        follows it)."""
        reader = _Reader(self.upstream)
        try:
            while True:
                head = reader.head()
                status = int(head.split(b" ", 2)[1])
                if 100 <= status < 200:
                    self.client.sendall(head)
                    continue
                method, losing = self.sent.popleft()
                if losing is not None:
                    losing.status = status
                    losing.reached.set()
                    return
                self.client.sendall(head)
                if method != "HEAD" and status not in (204, 304):
                    _forward_body(reader, head, self.client)
        except (_Closed, OSError, ValueError, IndexError):
            pass
        finally:
            self.close()


class S3Proxy:
    """A proxy on 127.0.0.1 in front of the S3 endpoint on `target_port`; `endpoint` is its address."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._faults: list[Fault] = []      # armed, not fired yet
        self._armed: list[Fault] = []       # every fault, for `close` to release
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_reply(self, method: str, fragment: str) -> Fault:
        """Lose the reply to the next `method` request whose path holds `fragment`."""
        return self._arm(Fault(method, fragment, "lose"))

    def hold(self, method: str, fragment: str) -> Fault:
        """Hold the next `method` request whose path holds `fragment` until its `release`."""
        return self._arm(Fault(method, fragment, "hold"))

    def refuse(self, method: str, fragment: str) -> Fault:
        """Close, unsent, every `method` request whose path holds `fragment` until the fault's `release`."""
        return self._arm(Fault(method, fragment, "refuse"))

    def disarm(self, fault: Fault) -> None:
        """Take back a fault that has not fired (a step that sent no such request)."""
        with self._lock:
            self._faults = [armed for armed in self._faults if armed is not fault]

    def _arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
            self._armed.append(fault)
        return fault

    def take(self, method: str, path: str) -> Fault | None:
        """The first armed fault this request fires (then disarmed, but for a refusal not yet released)."""
        with self._lock:
            for fault in self._faults:
                if fault.kind == "refuse" and fault.released.is_set():
                    continue
                if method in fault.method.split("|") and fault.fragment in path:
                    if fault.kind != "refuse":
                        self._faults.remove(fault)
                    return fault
        return None

    def _accept(self) -> None:
        for client, upstream in _connections(self.server, self.target):
            connection = _Connection(self, client, upstream)
            with self._lock:
                self._connections.append(connection)
            threading.Thread(target=connection.requests, daemon=True).start()
            threading.Thread(target=connection.replies, daemon=True).start()

    def close(self) -> None:
        """Stop accepting, release every held request and close every connection."""
        self.server.close()
        with self._lock:
            for fault in self._armed:
                fault.release()
            connections = list(self._connections)
        for connection in connections:
            connection.close()


class StallingProxy:
    """A TCP proxy to the object store that stops forwarding bytes while `stall`ed, keeping every
    connection open, and that forwards at most `bytes_per_s` (0: no limit)."""

    def __init__(self, target_port: int, bytes_per_s: int = 0) -> None:
        self.target = target_port
        self.bytes_per_s = bytes_per_s
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        """Stop forwarding (bytes already sent stay sent; connections stay open)."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def _accept(self) -> None:
        for client, upstream in _connections(self.server, self.target):
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                # A stall lasts until `resume` or `close`; past WAIT_S the path is given up.
                if not self._flowing.wait(WAIT_S) or self._closed.is_set():
                    return
                sink.sendall(chunk)
                if self.bytes_per_s:
                    time.sleep(len(chunk) / self.bytes_per_s)   # the capped rate
        except OSError:
            pass
        finally:
            for s in (source, sink):
                s.close()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()   # a stalled pipe wakes and ends
        self.server.close()
