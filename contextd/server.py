"""The contextd process: root lock, private socket, gRPC server, clean shutdown.

  - one daemon per root: an exclusive, non-blocking flock on ROOT/contextd.lock; a second daemon
    names the pid that holds it and exits;
  - the socket sits in a 0700 folder and is itself 0600; a live socket at the path is never
    taken over, a stale one (nothing answers) is replaced;
  - SIGTERM / SIGINT: stop taking calls, let in-flight calls and queued commits finish, close
    LMDB, remove the socket.

Depends on contextd.daemon, contextd.service, contextd.paths, contextd.errors, contextd.wire.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import grpc

from contextd._gen import contextd_pb2_grpc as pb_grpc
from contextd.daemon import Daemon, DaemonConfig
from contextd.errors import AlreadyRunning, InvalidArgument
from contextd.paths import MAX_SOCKET_PATH, private_file, private_folder, target
from contextd.service import ContextdService
from contextd.wire import grpc_options

log = logging.getLogger("contextd")

WORKERS = 64
IDLE_SWEEP_S = 600.0  # how often sessions idle past --max-idle are deleted (gc does it at once)
SHUTDOWN_GRACE_S = 10.0


def _lock_root(root: Path) -> IO[str]:
    """Hold ROOT/contextd.lock for the life of the process, or raise AlreadyRunning."""
    path = root / "contextd.lock"
    handle = open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600), "a+")
    private_file(path)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise AlreadyRunning(f"another contextd (pid {holder}) is already serving {root}; "
                             "stop it first or choose another --root") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def _private_folder(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = folder.stat()
    if info.st_uid != os.getuid():
        raise InvalidArgument(f"socket folder {folder} belongs to another user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(folder, 0o700)


def _claim_socket_path(path: Path) -> None:
    if len(str(path)) > MAX_SOCKET_PATH:
        raise InvalidArgument(f"socket path {path} is {len(str(path))} bytes; Unix sockets allow "
                              f"{MAX_SOCKET_PATH}: choose a shorter --socket")
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # stale: left by a daemon that died without cleaning up
        return
    finally:
        probe.close()
    raise AlreadyRunning(f"a daemon is already listening on {path}; choose another --socket")


class _UndecodableIsInvalid(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    """A request body that is not the method's message is the caller's mistake: INVALID_ARGUMENT,
    where grpcio would answer INTERNAL ('Exception deserializing request!'), which reads as a fault
    of the daemon. The generated handlers are kept; only their decoding moves inside the call."""

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer
        method = details.method

        def parse(raw: bytes, context: grpc.ServicerContext) -> Any:
            try:
                return decode(raw)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and kin
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{method}: the request body is not a valid message ({exc})")

        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            unary = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(lambda raw, ctx: unary(parse(raw, ctx), ctx),
                                                       response_serializer=serialize)
        if handler.unary_stream is not None:
            stream = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(lambda raw, ctx: stream(parse(raw, ctx), ctx),
                                                        response_serializer=serialize)
        return handler


def serve(config: DaemonConfig, socket_path: Path, announce: IO[str] = sys.stderr) -> int:
    """Run the daemon until SIGTERM or SIGINT; return the process exit status."""
    private_folder(config.root)  # LMDB holds the transcript, store/ the K/V: the user's code
    lock = _lock_root(config.root)
    _private_folder(socket_path.parent)
    _claim_socket_path(socket_path)
    daemon = Daemon(config)
    service = ContextdService(daemon)
    server = grpc.server(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="contextd"),
                         options=grpc_options(), maximum_concurrent_rpcs=WORKERS * 4,
                         interceptors=[_UndecodableIsInvalid()])
    pb_grpc.add_ContextdServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    if server.add_insecure_port(target(socket_path)) == 0:
        raise InvalidArgument(f"cannot listen on {socket_path}")
    server.start()
    os.chmod(socket_path, 0o600)

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("contextd: signal %d, draining", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"contextd: serving {config.root} on {target(socket_path)} (sync {config.sync.value}, pid {os.getpid()})",
          file=announce, flush=True)
    try:
        swept = time.monotonic()
        while not stop.wait(1.0):
            if time.monotonic() - swept >= IDLE_SWEEP_S:
                swept = time.monotonic()
                for session_id in daemon.idle_sessions():
                    log.info("contextd: session %s idle past the retention age; deleted", session_id)
                    daemon.delete_session(session_id)
    finally:
        service.stop_watchers()
        server.stop(SHUTDOWN_GRACE_S).wait()
        daemon.close()
        socket_path.unlink(missing_ok=True)
        lock.close()
    print("contextd: stopped cleanly", file=announce, flush=True)
    return 0
