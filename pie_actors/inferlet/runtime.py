"""Running inferlets against an engine in this process: the host operations behind the SDK.

`InferletHost` is the `HostApi` of one run. It owns an asyncio loop thread with one
`EngineClient` connection to the engine's data plane (so every sequence the run creates is
freed when the connection closes, however the run ends), the model's host-side `Tokenizer` and
chat template, the run's working-set handles (engine sequences) and compiled epilogues.

Host operations (the guest SDK's calls; see sdk/inferlet/):
    model.info / model.encode / model.decode
    chat.prefix / chat.system / chat.user / chat.assistant / chat.cue /
        chat.cue_without_thinking / chat.stop_tokens
    ws.create / ws.fork / ws.state / ws.reserve
    eta.epilogue (IR -> compiled id) / eta.submit (pass -> future id)
    session.receive / receive_file / send_file / file / send_to (session_ops.py)

Pass ordering: `eta.submit` schedules the pass on the loop thread with
`run_coroutine_threadsafe`, which keeps call order, and the coroutine writes its request frame
before its first suspension, so a pipeline's passes reach the engine in submission order; the
engine keeps the passes of one sequence in arrival order.

`run_inferlet(source, input, engine_address)` runs one inferlet end to end.
"""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from .. import protocol
from .engine_client import EngineClient, EngineError
from .chat_ops import ChatOps
from .host import HostApi, HostOpError, InferletError, Sandbox
from .session_ops import SessionOps

__all__ = ["InferletHost", "run_inferlet", "ir_to_epilogue", "default_sandbox"]

# Engine runtime constants the engine does not report yet (no channels or run-ahead so far).
FRAME_SIZE = 1
CHANNEL_CAPACITY = 64
RUN_AHEAD_WINDOW = 4
CONNECT_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------------------------------
# epilogues: the guest's traced IR -> an engine epilogue (the seam for issue 4's compiler)

@dataclass(frozen=True)
class CompiledEpilogue:
    spec: dict[str, Any]          # the engine's epilogue spec for the pass request
    lane: int                     # the lane whose read-out rows the result is taken from


def ir_to_epilogue(ir: dict[str, Any]) -> CompiledEpilogue:
    """Compile a traced epilogue IR {"ops": [[op, args], ...], "outputs": [ref, ...]}.

    Supported so far: exactly `reduce_argmax(intrinsics.output(lane, "logits"))`, which maps to
    the engine's "argmax" epilogue. The full IR compiler (torch / Triton backends) is issue 4;
    anything else is refused with a message naming the operation.
    """
    ops, outputs = ir.get("ops"), ir.get("outputs")
    if not isinstance(ops, list) or not isinstance(outputs, list):
        raise HostOpError("an epilogue IR needs 'ops' and 'outputs' lists")
    supported = {"output", "reduce_argmax"}
    for op in ops:
        if op[0] not in supported:
            raise HostOpError(f"epilogue operation {op[0]!r} is not supported yet: this runtime runs "
                              "only reduce_argmax(intrinsics.output(lane, 'logits')) "
                              "(the epilogue compiler comes with issue 4)")
    if len(outputs) != 1:
        raise HostOpError(f"epilogues with {len(outputs)} outputs are not supported yet (one output)")
    if (len(ops) == 2 and ops[0][0] == "output" and ops[1] == ["reduce_argmax", [{"t": 0}]]
            and outputs == [1]):
        lane, name = ops[0][1]
        if name != "logits":
            raise HostOpError(f"model output {name!r} is not available; known outputs: 'logits'")
        if type(lane) is not int or lane < 0:
            raise HostOpError(f"intrinsics.output lane must be a lane index, got {lane!r}")
        return CompiledEpilogue(protocol.ARGMAX, lane)
    raise HostOpError("this epilogue is not supported yet: only "
                      "reduce_argmax(intrinsics.output(lane, 'logits')) runs so far (issue 4)")


@lru_cache(maxsize=8)
def _tokenizer(model_dir: str):
    from ..gpu.tokenizer import Tokenizer   # tokenizers + jinja2 only, no torch

    return Tokenizer.from_dir(model_dir)


# ---------------------------------------------------------------------------------------------
# the host of one run

class InferletHost(ChatOps, SessionOps, HostApi):
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
            self.info: protocol.Info = self._wait(self.client.info(), CONNECT_TIMEOUT_S)
        except BaseException:
            self._stop_loop()
            raise
        self.model_dir = model_dir or self.info["model_dir"]
        self._tok = None
        self._ws: dict[int, int] = {}                      # working-set handle -> engine sequence
        self._epilogues: list[CompiledEpilogue] = []
        self._epilogue_ids: dict[str, int] = {}
        self.passes = 0

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

    # -- working sets ---------------------------------------------------------------------------

    def _seq(self, handle) -> int:
        seq = self._ws.get(handle) if type(handle) is int else None
        if seq is None:
            raise HostOpError(f"unknown working set {handle!r}")
        return seq

    def _ws_create(self, args) -> int:
        seq = self._wait(self.client.create())
        handle = len(self._ws) + 1
        self._ws[handle] = seq
        return handle

    def _ws_fork(self, handle) -> int:
        seq = self._wait(self.client.fork(self._seq(handle)))
        child = len(self._ws) + 1
        self._ws[child] = seq
        return child

    def _ws_state(self, handle) -> dict:
        return self._wait(self.client.state(self._seq(handle)))

    def _ws_reserve(self, args) -> None:
        handle, end = args
        self._wait(self.client.reserve(self._seq(handle), end))

    # -- passes ---------------------------------------------------------------------------------

    def _epilogue(self, ir_text) -> int:
        eid = self._epilogue_ids.get(ir_text)
        if eid is None:
            try:
                ir = json.loads(ir_text)
            except (TypeError, ValueError):
                raise HostOpError("epilogue IR is not JSON") from None
            self._epilogues.append(ir_to_epilogue(ir))
            eid = self._epilogue_ids[ir_text] = len(self._epilogues) - 1
        return eid

    def _submit(self, args) -> int:
        lanes_in = args.get("lanes") if isinstance(args, dict) else None
        if not isinstance(lanes_in, list) or not lanes_in:
            raise HostOpError("a pass needs at least one lane")
        eid = args.get("epilogue")
        epilogue = None
        if eid is not None:
            if type(eid) is not int or not 0 <= eid < len(self._epilogues):
                raise HostOpError(f"unknown epilogue {eid!r}")
            epilogue = self._epilogues[eid]
            if epilogue.lane >= len(lanes_in):
                raise HostOpError(f"the epilogue reads lane {epilogue.lane} of a pass with "
                                  f"{len(lanes_in)} lane(s)")
        lanes, rows = [], []
        for lane in lanes_in:
            spec = {k: v for k, v in lane.items() if k != "ws"}
            spec["seq"] = self._seq(lane.get("ws"))
            lanes.append(spec)
            rows.append(len(lane["readout"]) if lane.get("readout") is not None else 1)
        fid = self.futures.new()
        self.passes += 1
        asyncio.run_coroutine_threadsafe(self._pass(fid, lanes, epilogue, rows), self.loop)
        return fid

    async def _pass(self, fid: int, lanes: list, epilogue: CompiledEpilogue | None, rows: list[int]) -> None:
        # no await before the request is written: passes go out in submission order
        try:
            out = await self.client.forward(lanes, epilogue.spec if epilogue else protocol.ARGMAX)
            if epilogue is None:
                value = None
            else:
                start = sum(rows[:epilogue.lane])
                mine = out[start:start + rows[epilogue.lane]]
                value = mine[0] if len(mine) == 1 else mine
        except EngineError as e:
            self._complete(fid, error=f"{e.type}: {e.message}")
        except BaseException as e:   # never leave the guest waiting on a pass that failed here
            self._complete(fid, error=f"{type(e).__name__}: {e}")
            if not isinstance(e, Exception):
                raise
        else:
            self._complete(fid, value=value)

    def _complete(self, fid: int, value: Any = None, error: str | None = None) -> None:
        try:
            if error is not None:
                self.futures.fail(fid, error)
            else:
                self.futures.resolve(fid, value)
        except KeyError:
            pass   # the run is over; nobody waits for it

    # op -> method name (looked up on the instance, so subclasses can override a handler)
    _OPS: dict[str, str] = {**ChatOps.CHAT_OPS, **SessionOps.SESSION_OPS,
        "model.info": "_model_info", "model.encode": "_encode", "model.decode": "_decode",
        "ws.create": "_ws_create", "ws.fork": "_ws_fork", "ws.state": "_ws_state",
        "ws.reserve": "_ws_reserve",
        "eta.epilogue": "_epilogue", "eta.submit": "_submit",
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
