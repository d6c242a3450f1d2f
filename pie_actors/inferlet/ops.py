"""The host of one inferlet run: `InferletHost`, the HostApi behind the guest SDK's calls.

It owns an asyncio loop thread with one `EngineClient` connection to the engine's data plane (so
every sequence the run creates is freed when the connection closes, however the run ends), the
model's host-side `Tokenizer` and chat template, and (through its mixins) the run's working sets,
programs and channels. What the run streams (`session.send`, `session.send_file`) goes to `emit`
as events.

Host operations (the guest SDK's calls; see sdk/inferlet/), by mixin:
    model.info / model.encode / model.decode                          (here)
    chat.*                                                            (chat_ops.py)
    ws.*, eta.program / submit / run_ahead..., chan.*                  (eta_ops.py)
    session.receive / receive_file / send_file / file / send_to       (session_ops.py)
"""
from __future__ import annotations

import asyncio
import threading
from functools import lru_cache
from typing import Any, Callable

from ..config import RunLimits
from ..gpu.engine import wire
from ..process import Event, Send
from .chat_ops import ChatOps
from .engine_client import EngineClient, EngineError
from .eta_ops import EtaOps
from .host import HostApi, HostOpError, InferletError
from .session_ops import SessionOps

__all__ = ["InferletHost"]

FRAME_SIZE = 1               # passes per scheduler frame, as model.frame_size() reports it
CONNECT_TIMEOUT_S = 30.0


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str):
    from ..tokenizer import Tokenizer   # tokenizers + jinja2 only, no torch

    return Tokenizer.from_dir(model_dir)


# ---------------------------------------------------------------------------------------------
# the host of one run

class InferletHost(ChatOps, SessionOps, EtaOps, HostApi):
    """Host operations of one inferlet run, connected to the engine at `engine_address`."""

    def __init__(self, engine_address: tuple[str, int], *, limits: RunLimits, emit: Callable[[Event], None],
                 files: dict[str, bytes] | None = None,
                 send_to: Callable[[str, Any], None] | None = None) -> None:
        super().__init__()
        self.limits, self.emit = limits, emit
        self._init_session(files, send_to)
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
        self.model_dir = self.info["model_dir"]
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
        self.emit(Send(message))

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
                "frame_size": FRAME_SIZE, "channel_capacity": self.limits.channel_capacity,
                "run_ahead_window": self.limits.run_ahead_window, "max_position": info["max_position"]}

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
