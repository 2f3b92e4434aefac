"""Nothing waits for ever (H1): a restore waits on its file readers with a deadline, a reader
stuck in the kernel fails its restore with a clear error and is never served, the MLX greedy
steps' cleanup never waits for the runtime's lock on a thread that is not theirs, and a server
whose worker or reader is stuck says so on /health (503) instead of hanging.

Real parts only: the MLX and torch runtimes on the tiny model, real block files, the real
`kv-elision serve` with its contextd. A reader is wedged by the read hook of backends.read_stalls
(KV_ELISION_READ_HANG): the read blocks in the kernel, in open(2) of a FIFO, until the test opens
the FIFO's other end, as a read from a hung disk blocks until the disk answers.
"""

from __future__ import annotations

import gc
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from backends import blockfile, load_backend, read_stalls
from backends.section_reader import ReadQueue, SectionReader
from harness.faults.hangs import finalizer_case, twin_answers, wedged_read_case
from harness.faults.processes import short_tempdir
from harness.waits import wait_until

DEADLINE_S = 20.0   # the longest any step here may take before the test calls it a hang
READ_DEADLINE_S = 1.0   # the wedged readers' deadline (read_stalls.READ_DEADLINE_S)


def test_a_wedged_reader_fails_its_wait_at_the_deadline_and_never_leaves_its_bytes_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read stuck in the kernel (the hook holds the read queue's thread as it issues its
    request) makes the waits on it fail at the deadline, not wait for ever; `close` gives up on
    the thread, which stays listed as stuck until it returns, and then zeroes the bytes it read
    into the caller's buffers, which the caller had cleared and left."""
    monkeypatch.setattr(read_stalls, "READ_DEADLINE_S", READ_DEADLINE_S)
    keys = np.arange(4 * 64 * 256, dtype=np.float32).reshape(4, 64, 256)   # 256 KiB: more than the first read
    data = b"".join(bytes(piece) for piece in blockfile.pack(b"KVEBLOCK", {"kind": "test"}, [("keys", keys)]))
    path = tmp_path / "page.kv"
    path.write_bytes(data)
    reached, released = threading.Event(), threading.Event()
    reads = 0

    def hook(on_opener: bool) -> None:
        nonlocal reads
        reads += 0 if on_opener else 1
        if reads == 2:                     # the first read of the bulk, after the header's
            reached.set()
            released.wait(DEADLINE_S)

    before = read_stalls.set_read_hook(hook)
    target = np.zeros(keys.nbytes, dtype=np.uint8)
    try:
        reader = SectionReader(path, b"KVEBLOCK", blockfile.checksum(data), len(data), ReadQueue(1),
                               landing=frozenset({"keys"}))
        reader.land({"keys": [memoryview(target)]})
        assert reached.wait(DEADLINE_S), "the bulk read never started"
        started = time.monotonic()
        with pytest.raises(read_stalls.ReadStalled, match="no byte arrived"):
            reader.wait("keys")
        assert time.monotonic() - started < READ_DEADLINE_S + 2.0
        reader.close()
        assert time.monotonic() - started < READ_DEADLINE_S + 2.0, "close waited again for the stuck thread"
        target[:] = 0                      # what a restore that failed does with its slots
        assert [stuck.path for stuck in read_stalls.stuck_reads()] == [str(path)]
    finally:
        released.set()
        read_stalls.set_read_hook(before)
    wait_until(lambda: not read_stalls.stuck_reads(), DEADLINE_S, "the reader stayed stuck once its read returned")
    assert not target.any(), "the late read left the file's bytes in the caller's buffer"


def test_a_greedy_step_collected_on_another_thread_does_not_wait_for_the_runtime_lock() -> None:
    """A fork left with a greedy step ahead is garbage in a cycle (its generator's frame holds the
    fork); the collector may finalize it on any thread, a restore's reader thread included, while
    the restore holds the runtime's lock and waits for that reader. The finalizer must not wait
    for the lock there: held here, as a restore holds it, a collection on another thread ends."""
    pytest.importorskip("mlx")
    backend = load_backend("mlx", "tiny-llama", capacity=512)
    fork = backend.fork()
    fork.prefill(list(range(5, 40)))
    token = fork.decode(greedy=True)
    fork.decode(token, greedy=True)          # the second greedy decode leaves a step dispatched ahead
    assert getattr(fork, "_steps", None) is not None
    collected = threading.Event()

    def collect() -> None:
        gc.collect()
        collected.set()

    gc.disable()   # the collection that finds the fork is the other thread's, not one this thread triggers
    try:
        del fork
        with backend._rt.lock:                # type: ignore[attr-defined]  # what a restore holds
            collector = threading.Thread(target=collect, name="kv-read-queue", daemon=True)
            collector.start()
            done = collected.wait(DEADLINE_S)
        collector.join(DEADLINE_S)
    finally:
        gc.enable()
    assert done, "the collector waited for the runtime lock on a thread that does not hold it"


@pytest.fixture(scope="module")
def hang_work() -> Iterator[Path]:
    folder = short_tempdir("kvh-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def expected(hang_work: Path) -> str:
    """What the wedged turn answers on a server that never hangs."""
    return twin_answers(hang_work)


@pytest.mark.parametrize("where", ["reader", "caller"])
def test_a_wedged_read_is_answered_503_in_its_deadline_and_the_server_answers_again_once_it_returns(
        hang_work: Path, expected: str, where: str) -> None:
    """A read wedged on the read queue's thread fails its restore at the read deadline (the turn
    503, the page not served); one wedged on the worker's own thread is a step past
    --stuck-after (the watchdog: /health and the waiting turn 503, not a hang). Either way a new
    turn is refused 503 while it is stuck, and once the read returns /health is 200 again and the
    turn sent again answers as a server that never hung."""
    outcome = wedged_read_case(hang_work / where, where, expected)
    assert not outcome.problems, outcome.as_dict()
    assert outcome.answered_503_in_deadline and outcome.recovered, outcome.as_dict()


def test_a_dropped_sessions_greedy_step_finalized_on_the_reader_thread_does_not_hang_the_restore(
        hang_work: Path) -> None:
    """The collector finalizes a dropped MLX session on the reader thread of a restore that holds
    the runtime's lock (a real Engine and Worker in a child process): the restore goes through."""
    pytest.importorskip("mlx")
    outcome = finalizer_case(hang_work / "finalizer")
    assert not outcome.problems, outcome.as_dict()
    assert outcome.turn_status == 200 and outcome.answered_in_deadline, outcome.as_dict()
