"""`RunState`: what the host-glue classes of one inferlet run (the *_ops.py modules) share.

The engine connection (an `EngineClient` on the host loop, so every sequence the run creates is
freed when it closes, however the run ends), the run's `FutureTable`, the engine's
`info`, the run's limits and deadline, where its Send / File events go, and the model's tokenizer
and chat pieces. Nothing else is shared between the glue classes.

A run is given its engine's address, or an `EngineChoice`: one of the model's engine replicas is
chosen at the run's first pass (`bind`), by the tokens it starts with (the replica caching most of
them), and the run connects only then. Until then the glue classes keep what they make for the
engine (engine_link.py).

The host loop (`host_loop`) is one event-loop thread for all the runs of a process, started with
the first, rather than one a run: a run's own loop thread woke twice a token and contended for the
interpreter lock with the guests' and the engine's threads, where one thread reads the replies of
many runs that arrive together in one wake-up (bench/RESULTS.md, "Speed edits kept"). Nothing on
it may block. A run's tasks on it end with the run (`close`).

When the engine ends the connection (it died, or closed), every call waiting on it fails with the
reason, and so do the host futures that wait on what it streams (`on_lost`: channel values),
at once rather than at the run's deadline.

Host time is not guest time: the sandbox's deadline stops guest code, not a host operation that
waits. So every wait of a host operation has a bound of its own and ends by the run's deadline too
(`time_left`); past the deadline the run ends as a timeout.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any, Callable, Coroutine

from ..config import RunLimits
from ..event_loop import new_event_loop
from ..gpu.engine import wire
from ..process import Event
from .chat_ops import ChatTokens, chat_tokens
from .engine_client import EngineClient, EngineError
from .host import FutureTable, HostOpError, InferletError

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

__all__ = ["RunState", "EngineChoice", "host_loop", "CONNECT_TIMEOUT_S", "HOST_WAIT_S"]

CONNECT_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 10.0
HOST_WAIT_S = 30.0          # the longest a host operation waits for an engine reply


@dataclass(frozen=True)
class EngineChoice:
    """An engine not chosen yet: the model's `info` (the same on each of its replicas) and
    `choose(prefix, timeout)`, the address of the replica for a run whose first pass starts with
    the tokens `prefix` (None: not known)."""

    info: wire.Info
    choose: Callable[[list[int] | None, float], wire.EngineAddress]


_host_loop: tuple[int, asyncio.AbstractEventLoop] | None = None    # (the process that started it, loop)
_host_loop_lock = threading.Lock()


def host_loop() -> asyncio.AbstractEventLoop:
    """The event loop of this process's runs, on a thread of its own (started on first use)."""
    global _host_loop
    with _host_loop_lock:
        if _host_loop is None or _host_loop[0] != os.getpid():    # a forked child has no loop thread
            loop = new_event_loop()
            threading.Thread(target=loop.run_forever, name="inferlet-host", daemon=True).start()
            _host_loop = (os.getpid(), loop)
        return _host_loop[1]


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


@lru_cache(maxsize=8)
def model_tokenizer(model_dir: str) -> Tokenizer:
    """The tokenizer of the model at `model_dir`, loaded once a process (~150 ms with its chat
    template): the runs of a process share it, and a process that will serve runs loads it at start."""
    from ..tokenizer import Tokenizer   # tokenizers + jinja2 only (no torch), loaded when first needed

    return Tokenizer.from_dir(model_dir)


class RunState:
    """The state of one run that several host interfaces need; `close()` ends its connection."""

    def __init__(self, engine: wire.EngineAddress | EngineChoice, *, futures: FutureTable, limits: RunLimits,
                 emit: Callable[[Event], None], owner: str | None = None) -> None:
        self.futures, self.limits, self.emit, self.owner = futures, limits, emit, owner
        self.deadline = time.monotonic() + limits.timeout_s     # the run's, as the sandbox counts it
        self._posted: list[Callable[[], None]] = []    # for the loop thread, not yet handed over
        self._posted_lock = threading.Lock()
        self.loop = host_loop()
        self._tasks: set[asyncio.Task] = set()          # started by `start_task` (on the loop thread)
        self._closed = False
        self.restartable = False     # runtime.declare_restartable: may run again if its engine is lost
        self.tokens = 0              # what the run cost the engine (`close` reads it), its ended children's too
        self.client: EngineClient | None = None         # None until `bind`, with an EngineChoice
        self.on_push: Callable[[dict], None] | None = None   # engine pushes (channel_ops.py)
        self.on_receive: Callable[[int], None] | None = None   # the future of a message awaited (pass_ops.py)
        self.on_lost: list[Callable[[str], None]] = []   # told why, on the loop thread, if the engine ends the connection
        self._choice = engine if isinstance(engine, EngineChoice) else None
        try:
            if self._choice is None:
                self._connect(engine, starting=True)     # at the launch: the first pass is to come
                self.info: wire.Info = self._wait(self.client.info(), CONNECT_TIMEOUT_S)
            else:
                self.info = self._choice.info
        except BaseException:
            with contextlib.suppress(Exception):     # the error that matters is the one raised
                self._close_client()
            raise
        self._tok: Tokenizer | None = None

    # -- the engine connection ------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        """Whether the run is connected to its engine."""
        return self.client is not None

    def bind(self, prefix: list[int] | None = None) -> EngineClient:
        """The engine connection; with an EngineChoice not yet made, choose the replica for a
        first pass starting with `prefix` now and connect to it. Raises HostOpError when no
        replica can be chosen or reached."""
        if self.client is None:
            try:
                address = self._choice.choose(prefix, self.time_left(CONNECT_TIMEOUT_S))
                self._connect(address)
            except (HostOpError, InferletError):
                raise
            except Exception as e:       # the Controller or the engine is not there
                raise HostOpError(f"cannot reach an engine of {self.info['model']!r}: {type(e).__name__}: {e}") from None
        return self.client

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) of the engine the run is connected to (None: not chosen yet)."""
        return None if self.client is None else self.client.address

    @property
    def lost_engine(self) -> bool:
        """Whether the run's engine connection ended from the engine's side."""
        return self.client is not None and self.client.lost_engine

    def _connect(self, address: wire.EngineAddress, starting: bool = False) -> None:
        client = self._wait(EngineClient.connect(*address, owner=self.owner, kv_pages=self.limits.kv_pages,
                                                 starting=starting, on_lost=self._lost), CONNECT_TIMEOUT_S)
        client.on_push = self._push
        self.client = client

    def _push(self, message: dict) -> None:
        if self.on_push is not None:
            self.on_push(message)

    def _lost(self, reason: str) -> None:
        for hook in self.on_lost:
            hook(reason)

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the loop thread, after everything posted before it, once the guest
        next turns its event loop (`flush`). Waking the loop thread at once would hand it the GIL
        while the guest is still in its host call (~0.5 ms a call in one process); at the turn,
        the guest is about to block or poll, so the hand-over costs nothing."""
        with self._posted_lock:
            self._posted.append(partial(fn, *args) if args else fn)

    def start_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` on the loop, posted like `post`; it is cancelled if it still runs when the run
        closes."""
        self.post(self._start_task, coro)

    def _start_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def flush(self) -> None:
        """Hand what was posted to the loop thread, in one wake-up."""
        with self._posted_lock:
            batch, self._posted = self._posted, []
        if batch:
            self.loop.call_soon_threadsafe(_run_all, batch)

    def time_left(self, bound: float) -> float:
        """Seconds a host operation may still wait: `bound`, cut to the run's deadline; raises the
        run's timeout once the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise InferletError("timeout", f"deadline of {self.limits.timeout_s:.3g} s passed while "
                                           "waiting on the host")
        return min(bound, left)

    def wait(self, coro: Coroutine[Any, Any, Any], timeout: float = HOST_WAIT_S) -> Any:
        """Run `coro` on the loop thread, after what was posted, and wait for its result (blocking
        host operations), `timeout` seconds at most and never past the run's deadline; an engine
        error becomes the guest's HostError."""
        try:
            left = self.time_left(timeout)
        except InferletError:
            coro.close()
            raise
        try:
            return self._wait(coro, left)
        except concurrent.futures.TimeoutError:
            self.time_left(timeout)          # the deadline passed meanwhile: the run's timeout
            raise HostOpError(f"the engine did not answer within {timeout:.3g} s") from None

    def _wait(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        self.flush()
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except EngineError as e:
            raise HostOpError(f"{e.type}: {e.message}") from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Close the engine connection (the engine frees every sequence of the run) and end the run's
        tasks."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.client is not None:
                try:
                    self.tokens += self._wait(self.client.usage(), CLOSE_TIMEOUT_S)
                except Exception:
                    pass             # the engine is gone: what it ran for the run is not known
            self._close_client()
        finally:
            self.loop.call_soon_threadsafe(self._cancel_tasks)

    def _close_client(self) -> None:
        if self.client is not None:
            self._wait(self.client.close(), CLOSE_TIMEOUT_S)

    # -- the model's text side ------------------------------------------------------------------

    @property
    def tok(self) -> Tokenizer:
        """The model's tokenizer, loaded on first use (runs that never encode do not pay for it)."""
        if self._tok is None:
            self._tok = model_tokenizer(self.info["model_dir"])
        return self._tok

    @property
    def chat(self) -> ChatTokens:
        """The token ids of conversation pieces in the model's chat template."""
        return chat_tokens(self.tok)

    # -- guest futures --------------------------------------------------------------------------

    def complete(self, fid: int, value: Any = None, error: str | None = None) -> None:
        """Resolve guest future `fid` with `value`, or fail it with `error` (from any thread)."""
        try:
            if error is not None:
                self.futures.fail(fid, error)
            else:
                self.futures.resolve(fid, value)
        except KeyError:
            pass   # the run is over; nobody waits for it
