"""Running inferlets against an engine in this process: the host operations behind the SDK.

`InferletHost` is the `HostApi` of one run. It owns an asyncio loop thread with one
`EngineClient` connection to the engine's data plane (so every sequence the run creates is
freed when the connection closes, however the run ends), the model's host-side `Tokenizer` and
chat template, and (through its mixins) the run's working sets, programs and channels.

Host operations (the guest SDK's calls; see sdk/inferlet/), by mixin:
    model.info / model.encode / model.decode                          (here)
    chat.*                                                            (chat_ops.py)
    ws.*, eta.program / submit / run_ahead..., chan.*                  (eta_ops.py)
    session.receive / receive_file / send_file / file / send_to       (session_ops.py)

`run_inferlet(source, input, engine_address)` runs one inferlet end to end.
"""
from __future__ import annotations

import asyncio
import threading
from functools import lru_cache
from typing import Any, Callable

from ..gpu.engine import wire
from .engine_client import EngineClient, EngineError
from .chat_ops import ChatOps
from .host import HostApi, HostOpError, InferletError, Sandbox
from .eta_ops import EtaOps
from .session_ops import SessionOps

__all__ = ["InferletHost", "run_inferlet", "default_sandbox"]

# Runtime constants the guest reads through model.*(): passes per frame, the channel capacity
# to ask for when a channel buffers a whole decode, passes a run-ahead keeps in flight.
FRAME_SIZE = 1
CHANNEL_CAPACITY = 1024
RUN_AHEAD_WINDOW = 8
CONNECT_TIMEOUT_S = 30.0


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str):
    from ..tokenizer import Tokenizer   # tokenizers + jinja2 only, no torch

    return Tokenizer.from_dir(model_dir)


# ---------------------------------------------------------------------------------------------
# the host of one run

class InferletHost(ChatOps, SessionOps, EtaOps, HostApi):
    """Host operations of one inferlet run, connected to the engine at `engine_address`."""

    def __init__(self, engine_address: tuple[str, int], *, on_send: Callable[[str], None] | None = None,
                 model_dir: str | None = None, files: dict[str, bytes] | None = None,
                 on_send_file: Callable[[bytes], None] | None = None,
                 send_to: Callable[[str, Any], None] | None = None) -> None:
        super().__init__()
        self.on_send = on_send
        self._init_session(files, on_send_file, send_to)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="inferlet-host", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.client: EngineClient = self._wait(EngineClient.connect(*engine_address), CONNECT_TIMEOUT_S)
            self.info: wire.Info = self._wait(self.client.info(), CONNECT_TIMEOUT_S)
        except BaseException:
            self._stop_loop()
            raise
        self.model_dir = model_dir or self.info["model_dir"]
        self._tok = None
        self._init_eta()

    # -- plumbing -------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    def _wait(self, coro, timeout: float | None = CONNECT_TIMEOUT_S):
        """Run `coro` on the loop thread and wait for its result (blocking host operations)."""
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
        except EngineError as e:
            raise HostOpError(f"{e.type}: {e.message}") from None

    def _stop_loop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    @property
    def tok(self):
        if self._tok is None:
            self._tok = _tokenizer(self.model_dir)
        return self._tok

    # -- HostApi --------------------------------------------------------------------------------

    def send(self, message: str) -> None:
        if self.on_send is not None:
            self.on_send(message)

    def call(self, op: str, args: Any) -> Any:
        name = self._OPS.get(op)
        if name is None:
            return super().call(op, args)
        return getattr(self, name)(args)

    def on_exit(self, error: InferletError | None) -> None:
        """Close the engine connection: the engine frees every sequence of the run."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wait(self.client.close(), 10)
        finally:
            self._stop_loop()

    # -- model ----------------------------------------------------------------------------------

    def _model_info(self, args) -> dict:
        info = self.info
        return {"name": info["model"], "architecture": info["architecture"],
                "output_vocab_size": info["vocab_size"], "kv_page_size": info["page_size"],
                "frame_size": FRAME_SIZE, "channel_capacity": CHANNEL_CAPACITY,
                "run_ahead_window": RUN_AHEAD_WINDOW, "max_position": info["max_position"]}

    def _encode(self, text) -> list[int]:
        if not isinstance(text, str):
            raise HostOpError("model.encode takes a string")
        return self.tok.encode(text)

    def _decode(self, tokens) -> str:
        if not isinstance(tokens, list) or any(type(t) is not int for t in tokens):
            raise HostOpError("model.decode takes a list of token ids")
        try:
            return self.tok.decode(tokens)
        except ValueError as e:
            raise HostOpError(str(e)) from None

    def _complete(self, fid: int, value: Any = None, error: str | None = None) -> None:
        try:
            if error is not None:
                self.futures.fail(fid, error)
            else:
                self.futures.resolve(fid, value)
        except KeyError:
            pass   # the run is over; nobody waits for it

    # op -> method name (looked up on the instance, so subclasses can override a handler)
    _OPS: dict[str, str] = {**ChatOps.CHAT_OPS, **SessionOps.SESSION_OPS, **EtaOps.ETA_OPS,
        "model.info": "_model_info", "model.encode": "_encode", "model.decode": "_decode",
    }

# ---------------------------------------------------------------------------------------------
# one-shot runs

_default_sandbox: Sandbox | None = None
_sandbox_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """A process-wide Sandbox on the shared runner component (runs may be concurrent)."""
    global _default_sandbox
    with _sandbox_lock:
        if _default_sandbox is None:
            _default_sandbox = Sandbox()
        return _default_sandbox


def run_inferlet(source: str, input: Any, engine_address: tuple[str, int], *,
                 on_send: Callable[[str], None] | None = None, timeout: float = 300.0,
                 sandbox: Sandbox | None = None, memory_limit: int | None = None,
                 messages: list[Any] = (), files: dict[str, bytes] | None = None,
                 on_send_file: Callable[[bytes], None] | None = None,
                 send_to: Callable[[str, Any], None] | None = None,
                 on_start: Callable[[InferletHost], None] | None = None) -> Any:
    """Run one inferlet (its main module's `source`) on `input` against the engine at
    `engine_address`; `session.send` text goes to `on_send` as it arrives, `messages` are
    what its `session.receive()` calls get, in order, `files` what `session.file(name)` reads.
    `on_start(host)` is called before the inferlet starts (to deliver messages or cancel it
    later). Returns main's result (a dict for the documents' programs); raises InferletError."""
    sandbox = sandbox or default_sandbox()
    try:
        host = InferletHost(tuple(engine_address), on_send=on_send, files=files,
                            on_send_file=on_send_file, send_to=send_to)
    except (OSError, HostOpError, TimeoutError) as e:
        raise InferletError("trap", f"cannot reach the engine at {engine_address}: "
                                    f"{type(e).__name__}: {e}") from None
    for message in messages:
        host.deliver(message)
    if on_start is not None:
        on_start(host)
    return sandbox.run(source, input, host, timeout=timeout, memory_limit=memory_limit)
