"""The one thread that touches the engine (`Worker`): it takes the turns the HTTP handlers submit,
runs them a step at a time in arrival order, and says when it is stuck.

Kept apart from the handler (serving.http) because it owns a different thing: the handler owns a
connection, the worker owns the model and every running turn. Depends on serving.engine,
serving.http_request (what a failed turn answers), serving.turn and backends (the decode step,
the store's stuck reads); never on serving.http.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus

from backends import DecodeStep, read_stalls
from serving.engine import Engine
from serving.http_request import RequestError, error_for
from serving.transcript import TranscriptError
from serving.turn import ChatRequest, TurnEvent

log = logging.getLogger("kv_elision.server")

# A step of the worker (a prefill chunk, a turn's plan and restores, a token) running longer than
# this is stuck (a read hung in the kernel, a deadlock): /health says so and turns are refused.
STUCK_AFTER_S = 120.0
CLIENT_POLL_S = 0.25  # how often a turn's client's socket is looked at, and a waiting handler's worker


@dataclass
class Job:
    request: ChatRequest
    events: queue.Queue[TurnEvent | RequestError]
    gone: threading.Event  # the client disconnected: a queued turn is dropped, a running one ends
    client_gone: Callable[[], bool] = lambda: False   # what the client's socket says (the handler's)
    checked: float = -math.inf   # when the socket was last looked at

    def left(self) -> bool:
        """Whether the client is gone: its handler said so (a write failed or timed out), or its
        socket says so, looked at once per CLIENT_POLL_S. The request's `cancelled`: the engine
        asks it between decoded tokens, the worker between the steps before the answer."""
        now = time.monotonic()
        if not self.gone.is_set() and now - self.checked >= CLIENT_POLL_S:
            self.checked = now
            if self.client_gone():
                log.info("client left session %s; ending its turn", self.request.session_id)
                self.gone.set()
        return self.gone.is_set()


@dataclass
class _Turn:
    job: Job
    steps: Generator[TurnEvent, int | None, None] = field(init=False)
    started: bool = False
    prepared: bool = False               # its prompt is in: from here it ends at a decoded token
    answered: bool = False               # its final event is out: it only reads ahead now
    decode: DecodeStep | None = None     # the decode step it waits on, run with the round's others
    token: int | None = None             # what that step picked, sent in at its next step
    failure: Exception | None = None     # or how the batched forward failed, thrown in instead


class Worker(threading.Thread):
    """The one thread that touches the engine (and so the model). It interleaves the turns of up
    to `resident_sessions` different sessions, a step at a time: each has a cache of its own, so
    going from one to the next moves no page (Engine.resume).

    It says when it cannot be trusted to answer (`stuck`): a step has run past `stuck_after_s`,
    or a read of the store is stuck in the kernel past its deadline (backends.read_stalls). Then
    /health answers 503, no turn starts, and a client waiting for a stuck step is answered 503:
    the server fails closed instead of leaving everyone waiting, and a supervisor can restart it."""

    def __init__(self, engine: Engine, stuck_after_s: float = STUCK_AFTER_S) -> None:
        super().__init__(name="kv-elision-worker", daemon=True)
        self.engine = engine
        self.stuck_after_s = stuck_after_s
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()  # held during a step; stats readers take it briefly between steps
        self.busy_since: float | None = None   # (monotonic) when the step running now began
        self.failure: BaseException | None = None  # why the loop ended early, when it did
        self.waiting: deque[Job] = deque()   # taken from `jobs`, not started yet (their session is busy)
        self.draining = False         # stopping: no turn starts; those running end by `cut_at`
        self.cut_at = math.inf        # (monotonic) when the turns still running are cut

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        """A step: the lock, and its start for the watchdog (`stuck`)."""
        with self.lock:
            self.busy_since = time.monotonic()
            try:
                yield
            finally:
                self.busy_since = None

    def step_stuck(self) -> str | None:
        """Why the step running now counts as stuck (it has run past `stuck_after_s`), or None."""
        began = self.busy_since
        if began is None or time.monotonic() - began <= self.stuck_after_s:
            return None
        return f"the worker's step has run for {time.monotonic() - began:.0f} s (over {self.stuck_after_s:g} s)"

    def stuck(self) -> str | None:
        """Why no turn may start now, or None: a stuck step, or a read stuck past its deadline,
        which may still write into a cache's free slots until it returns (read_stalls.stuck_reads)."""
        reads = read_stalls.stuck_reads()
        if reads:
            return (f"a read of the store has been stuck for {reads[0].stalled_s:.0f} s ({reads[0].path}; "
                    f"{len(reads)} in all)")
        return self.step_stuck()

    def refused(self, reason: str) -> RequestError:
        """The answer while the worker is stuck (`stuck`)."""
        return RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"the server is stuck: {reason}; try again later",
                            "worker_stuck")

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The lock, for a reader of the engine's state between steps; 503 once the step holding
        it is stuck, instead of waiting for it."""
        while not self.lock.acquire(timeout=CLIENT_POLL_S):
            reason = self.step_stuck()
            if reason is not None:
                raise self.refused(reason)
        try:
            yield
        finally:
            self.lock.release()

    def submit(self, request: ChatRequest, client_gone: Callable[[], bool] | None = None) -> Job:
        """Queue a turn; `client_gone` says whether its client has closed its end."""
        if self.failure is not None or self.draining:
            raise self.stopped()
        reason = self.stuck()
        if reason is not None:
            raise self.refused(reason)
        job = Job(request, queue.Queue(), threading.Event())
        if client_gone is not None:
            job.client_gone = client_gone
        request.cancelled = job.left
        self.jobs.put(job)
        return job

    def next_event(self, job: Job, wait_s: float) -> TurnEvent | RequestError | None:
        """The job's next event within `wait_s` seconds, else None; once the worker is gone and
        nothing is left for the job (it was submitted as the worker stopped), the answer no
        worker will send; once a step is stuck, 503 (the job is then let go: ended at its next
        step, should the worker come back)."""
        try:
            return job.events.get(timeout=wait_s)
        except queue.Empty:
            if not self.is_alive() and job.events.empty():
                return self.stopped()
            reason = self.step_stuck()
            if reason is not None:
                job.gone.set()
                return self.refused(reason)
            return None

    def stopped(self) -> RequestError:
        """The answer to a turn that no worker will run: the server is stopping, or its loop failed."""
        if self.failure is None:
            return RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is stopping")
        return RequestError(HTTPStatus.SERVICE_UNAVAILABLE,
                            f"the server's worker stopped ({type(self.failure).__name__}: {self.failure}); "
                            "restart the server", "worker_stopped")

    @property
    def queued(self) -> int:
        """Turns not started yet."""
        return self.jobs.qsize() + len(self.waiting)

    def drain(self, deadline: float) -> None:
        """Stop: turns not started are answered 503 and none starts any more; those running may
        finish until `deadline` (monotonic), then each is cut (`_cut`); the worker then ends."""
        self.cut_at = deadline
        self.jobs.put(None)

    def run(self) -> None:
        """Serve turns until told to stop (`drain`). A failure of the loop itself (not of one
        turn: `_step` answers those) ends the worker, but never silently: every turn queued or
        running is answered, later ones are refused (`submit`, `next_event`) and /health says so,
        so neither a client nor a supervisor waits on a thread that is gone."""
        running: list[_Turn] = []
        try:
            self._serve(self.waiting, running)
        except BaseException as exc:  # noqa: BLE001 - recorded and answered to every waiting client
            self.failure = exc
            log.critical("the worker stopped; turns are refused until the server restarts", exc_info=True)
            self._answer_all(self.waiting, running)

    def _answer_all(self, waiting: deque[Job], running: list[_Turn]) -> None:
        """Tell every turn running, waiting or still queued that no worker will run it (`stopped`)."""
        stopped = self.stopped()
        for job in [*(turn.job for turn in running), *waiting, *self._take(block=False)]:
            if job is not None:
                job.events.put(stopped)

    def _serve(self, waiting: deque[Job], running: list[_Turn]) -> None:
        while True:
            arrived = self._take(block=not running and not waiting and not self.draining)
            waiting.extend(job for job in arrived if job is not None)
            if None in arrived:   # the server is stopping
                self.draining = True
                log.info("stopping: %d turns running may finish for %.1f s, %d not started are refused",
                         len(running), max(0.0, self.cut_at - time.monotonic()), len(waiting))
            if self.draining:
                stopped = self.stopped()
                while waiting:
                    waiting.popleft().events.put(stopped)
                self._cut(running, time.monotonic() >= self.cut_at)
                if not running:
                    return
            self._admit(waiting, running)
            for turn in list(running):
                if not self._step(turn):
                    running.remove(turn)
            self._decode(running)

    def _cut(self, running: list[_Turn], deadline: bool) -> None:
        """While draining: close the turns that answered and only read ahead; at the drain's
        `deadline`, end the others too, each as cleanly as where it is allows: one decoding ends at
        its next token as a cancelled turn (the cache holds what was picked, written through, its
        lease ended by its record), one still before its answer is closed (its lease released,
        nothing recorded: the client sends it again)."""
        for turn in list(running):
            if not turn.answered and not deadline:
                continue
            if not turn.answered and turn.prepared:
                turn.job.gone.set()
                continue
            running.remove(turn)
            session_id = turn.job.request.session_id
            with self._working():
                try:
                    turn.steps.close()
                except Exception:  # noqa: BLE001 - every other turn is still cut
                    log.exception("session %s: ending its turn at shutdown failed", session_id)
            if not turn.answered:
                log.info("session %s: its turn was cut before its answer as the server stopped", session_id)
                turn.job.events.put(self.stopped())

    def _take(self, block: bool) -> list[Job | None]:
        """Every job queued now, the first one waited for when `block` (None: the server stops)."""
        taken: list[Job | None] = []
        while True:
            try:
                taken.append(self.jobs.get(block=block and not taken))
            except queue.Empty:
                return taken

    def _admit(self, waiting: deque[Job], running: list[_Turn]) -> None:
        """Start the waiting turns, in arrival order, of sessions with no turn running, while
        fewer than `resident_sessions` run; drop those whose client left. While the worker is
        stuck (a read that may still land in a cache's free slots) none starts: each is answered 503."""
        reason = self.stuck()
        if reason is not None:
            while waiting:
                waiting.popleft().events.put(self.refused(reason))
            return
        busy = {turn.job.request.session_id for turn in running}
        for job in list(waiting):
            if job.left():
                waiting.remove(job)
                log.info("session %s: the client left before its turn started; dropped", job.request.session_id)
                job.events.put(RequestError(HTTPStatus.BAD_REQUEST, "the client disconnected"))
            elif job.request.session_id not in busy and len(running) < self.engine.config.resident_sessions:
                waiting.remove(job)
                turn = _Turn(job)
                turn.steps = self.engine.chat(job.request)
                running.append(turn)
                busy.add(job.request.session_id)

    def _step(self, turn: _Turn) -> bool:
        """Advance one turn by a step: to its next pause, sending the client the events before it;
        False once it has ended. After its final event a turn only reads ahead for the controller
        model, a page a step (what else it leaves behind is there before its first pause). A pause
        with a decode step leaves the turn waiting for `_decode` when batching is on. Pauses are
        never sent to the client."""
        job = turn.job
        if turn.decode is not None:
            return True
        if not turn.prepared and job.left():
            self._drop(turn)
            return False
        with self._working():
            try:
                if turn.started:
                    self.engine.resume(job.request.session_id)
                turn.started = True
                token, failure, turn.token, turn.failure = turn.token, turn.failure, None, None
                event = turn.steps.throw(failure) if failure is not None else turn.steps.send(token)
                while not event.pause:
                    turn.prepared = turn.prepared or event.prepared is not None
                    turn.answered = turn.answered or event.final is not None
                    job.events.put(event)
                    event = next(turn.steps)
                if self.engine.config.batch_decode:
                    turn.decode = event.decode
                return True
            except StopIteration:
                return False
            except Exception as exc:  # noqa: BLE001 - the worker must outlive any one turn
                error = error_for(exc)
                if error.kind == "server_error":
                    log.exception("turn failed")
                job.events.put(error)
                if not isinstance(exc, TranscriptError):
                    self._forget(job.request.session_id)
                return False

    def _drop(self, turn: _Turn) -> None:
        """End a turn whose client left before its prompt was in: between two prefill chunks (or
        before the first), not after the whole prompt and a token for nobody. The turn is closed
        as a failed one is (its lease released, the session dropped from memory), so the
        session's next turn starts from what contextd holds; the server's totals count it as a
        cancelled turn."""
        session_id = turn.job.request.session_id
        with self._working():
            try:
                turn.steps.close()
            except Exception:  # noqa: BLE001 - the session is forgotten below either way
                log.exception("session %s: closing the turn its client left failed", session_id)
            if turn.started:
                self._forget(session_id)
                self.engine.totals.add(cancelled_turns=1)
        log.info("session %s: the client left before its prompt was in; the turn ended", session_id)
        turn.job.events.put(RequestError(HTTPStatus.BAD_REQUEST, "the client disconnected"))

    def _forget(self, session_id: str) -> None:
        """Drop a failed turn's session from memory, so that its next turn starts from the last
        durable state. Emptying its cache can fail too (the backend that failed the turn): the
        worker then logs it and serves on, since the session is dropped before its cache is."""
        try:
            self.engine.forget(session_id)
        except Exception:  # noqa: BLE001 - the worker must outlive any one turn
            log.exception("session %s: emptying its cache after the failed turn failed too", session_id)

    def _decode(self, running: list[_Turn]) -> None:
        """The round's waiting decode steps, in one forward: each turn takes its token, or the
        forward's failure, at its next step."""
        waiting = [turn for turn in running if turn.decode is not None]
        if not waiting:
            return
        steps = {turn.job.request.session_id: turn.decode for turn in waiting if turn.decode is not None}
        with self._working():
            try:
                tokens = self.engine.decode_batch(steps)
            except Exception as exc:  # noqa: BLE001 - each turn fails as its own decode would have
                for turn in waiting:
                    turn.failure = exc
            else:
                for turn, token in zip(waiting, tokens, strict=True):
                    turn.token = token
        for turn in waiting:
            turn.decode = None
