"""The `eta.program`, `eta.submit` and `eta.park` host operations (`PassOps`): programs and passes.

- Epilogues and prologues are eta programs: the guest's traced IR, its channels renamed to the
  engine's, is registered with the engine (compiled once per engine by IR hash). A handle is the
  run's own small integer, mapped to the engine's program id.
- Passes are written to the engine in submission order (`RunState.post` is FIFO and
  `EngineClient.start_pass` writes without awaiting). The run's first pass chooses its engine
  (engine_link.py) by the tokens of its first lane.
- A run parks (`Pipeline.park`, or `session.receive` still waiting after `limits.park_after_s`)
  once it has no pass in flight, unless it submits one first: the engine lets its working sets
  leave the KV pool first when the pool runs short, and brings them back at its next request on
  one (gpu/engine/saved.py), so the guest never sees it.
"""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Annotated, Any, Callable

from annotated_types import MinLen
from pydantic import Strict
from typing_extensions import NotRequired, TypedDict

from .channel_ops import ChannelOps
from .engine_client import EngineClient, EngineError
from .engine_link import EngineLink
from .host import HostOpError
from .host_op import host_op, shape
from .working_set_ops import WorkingSetOps

__all__ = ["PassOps", "Pass"]


@shape
class Lane(TypedDict):
    """One working set's rows in a pass (the engine's wire.LaneSpec, with the run's handles)."""

    ws: int
    tokens: list[int]
    chan: NotRequired[int | None]          # a channel the tokens are taken from when the pass runs
    positions: NotRequired[list[int] | None]
    slots: NotRequired[list[int] | None]
    kv_len: NotRequired[int | None]
    mask: NotRequired[list[list[bool]] | None]
    fold: NotRequired[bool | int]
    readout: NotRequired[list[int] | None]
    checkpoints: NotRequired[list[int] | None]   # slots to keep the recurrent state at (hybrid models)


# [site, program]: a JSON list, its items strictly typed
Adapter = Annotated[tuple[Annotated[str, Strict()], Annotated[int, Strict()]], Strict(False)]


@shape
class Pass(TypedDict):
    lanes: Annotated[list[Lane], MinLen(1)]
    epilogue: NotRequired[int | None]      # program handles (eta.program); no epilogue: argmax
    prologue: NotRequired[int | None]
    adapters: NotRequired[list[Adapter] | None]


@shape
class Program(TypedDict):
    ir: str


def _outputs(out: list) -> Any:
    """An epilogue's result for the guest: None, its one output, or the list of them."""
    return None if not out else out[0] if len(out) == 1 else out


def _nothing(out: Any) -> None:
    return None


class PassOps:
    interface = "passes"

    def __init__(self, link: EngineLink, ws: WorkingSetOps, channels: ChannelOps) -> None:
        self.link, self.run, self.ws, self.channels = link, link.run, ws, channels
        self._programs: dict[str, int] = {}               # IR text -> program handle
        self._pids: list[int | None] = [None]             # program handle -> engine program id
        self.puts: dict[int, set[int]] = {}               # program handle -> engine channels it puts into
        self._lock = threading.Lock()
        self._in_flight = 0                               # passes sent and not finished
        self._told_idle = False                           # the engine knows we wait on something else
        self._park = False                                # to park once no pass is in flight
        self._park_timer: asyncio.TimerHandle | None = None   # parks a run that waits for a message
        self.run.on_receive = self._receiving

    # ---- programs -----------------------------------------------------------------------------

    @host_op("eta.program", Program)
    def program(self, ir: str) -> int:
        """Register a traced epilogue/prologue; errors in it are reported here, at trace time (or,
        before the engine is chosen, by the pass that chooses it)."""
        handle = self._programs.get(ir)
        if handle is None:
            handle = len(self._pids)
            self._pids.append(None)

            async def register(client: EngineClient) -> None:
                engine_ir, self.puts[handle] = self._engine_ir(ir)
                self._pids[handle] = await client.program(engine_ir)
            self.link.now_or_later(register)
            self._programs[ir] = handle
        return handle

    def _engine_ir(self, ir_text: str) -> tuple[str, set[int]]:
        """The IR with its channels named by the engine's ids, and the engine channels it puts
        into. IR the engine cannot read goes to it as it is: the engine says what is wrong."""
        try:
            ir = json.loads(ir_text)
            ops = [op for op in ir["ops"] if op[0] in ("take", "put")]
            for op in ops:
                op[1][0] = self.channels.engine_chan(op[1][0])
        except (ValueError, TypeError, KeyError, IndexError):
            return ir_text, set()
        return json.dumps(ir), {op[1][0] for op in ops if op[0] == "put"}

    def _engine_pid(self, handle: int | None) -> int | None:
        if handle is None:
            return None
        if not 0 < handle < len(self._pids):
            raise HostOpError(f"unknown program {handle!r} (register it with eta.program)")
        pid = self._pids[handle]
        if pid is None:
            raise HostOpError(f"program {handle} was not registered: {self.link.lost_steps}")
        return pid

    # ---- passes -------------------------------------------------------------------------------

    def pass_fields(self, lanes: list[Lane], epilogue: int | None = None, prologue: int | None = None,
                    adapters: list[tuple[str, int]] | None = None) -> dict[str, Any]:
        """The arguments of `EngineClient.start_pass` for a guest pass."""
        if not self.run.bound:       # the run's first pass; its working sets are all new
            self.link.client(lanes[0]["tokens"] or None)
        specs = []
        for lane in lanes:
            spec = {k: v for k, v in lane.items() if k not in ("ws", "chan")}
            spec["seq"] = self.ws.seq(lane["ws"])
            if lane.get("chan") is not None:
                spec["tokens_from"] = self.channels.engine_chan(lane["chan"])
            specs.append(spec)
        pid = self._engine_pid(epilogue)
        return {"lanes": specs, "epilogue": {"kind": "argmax"} if pid is None else {"kind": "program", "id": pid},
                "prologue": self._engine_pid(prologue),
                "adapters": [[site, self._engine_pid(p)] for site, p in adapters] if adapters else None}

    @host_op("eta.submit", Pass)
    def submit(self, lanes: list[Lane], epilogue: int | None = None, prologue: int | None = None,
               adapters: list[tuple[str, int]] | None = None) -> int:
        """Queue a pass; returns the future id of its epilogue's result (None without one)."""
        fields = self.pass_fields(lanes, epilogue, prologue, adapters)
        value = _outputs if epilogue is not None else _nothing
        fid = self.run.futures.new()
        self.send_pass(fields, [lane["ws"] for lane in lanes], lambda fut: self.pass_done(fid, fut, value))
        return fid

    def send_pass(self, fields: dict[str, Any], handles: list[int], done: Callable,
                  started: Callable | None = None) -> None:
        """Write the pass request on the loop thread, in submission order; `done(future)` when it
        ends (also when it cannot be sent). Its working sets count as busy until then."""
        self.ws.hold(handles)
        with self._lock:
            self._in_flight += 1
            self._told_idle = self._park = False

        def finished(fut) -> None:
            with self._lock:
                self._in_flight -= 1
                park = self._park and not self._in_flight
            if park:
                self.run.client.park()
            self.ws.release(handles)
            done(fut)

        def start() -> None:
            try:
                request_id, fut = self.run.client.start_pass(**fields)
            except EngineError as e:
                fut = self.run.loop.create_future()
                fut.set_exception(e)
            else:
                if started is not None:
                    started(request_id)
            fut.add_done_callback(finished)
        self.run.post(start)

    def pass_done(self, fid: int, fut, value: Callable[[Any], Any]) -> None:
        """Complete the guest's future `fid` with `value(result)` of an engine pass request."""
        if fut.cancelled():
            self.run.complete(fid, error="the pass was cancelled")
        elif fut.exception() is not None:
            e = fut.exception()
            self.run.complete(fid, error=f"{e.type}: {e.message}" if isinstance(e, EngineError) else str(e))
        else:
            self.run.complete(fid, value=value(fut.result()))

    def guest_waits(self) -> None:
        """The guest blocks with no pass in flight: it waits on a message, a tool, a timer or its
        client, so the engine's next batch must not wait for it (once per such wait)."""
        with self._lock:
            if self._in_flight or self._told_idle or not self.run.bound:
                return
            self._told_idle = True
        self.run.post(self.run.client.idle)

    # ---- parking ------------------------------------------------------------------------------

    @host_op("eta.park")
    def park(self) -> None:
        """Pipeline.park: park now, or once the passes in flight have run (unless the guest
        submits another first)."""
        if self._wants_park():
            self.run.post(self.run.client.park)

    def _wants_park(self) -> bool:
        """The run is to park: True when it can at once (bound to its engine, no pass in flight)."""
        with self._lock:
            self._park = True
            return self.run.bound and not self._in_flight

    def _receiving(self, fid: int) -> None:
        """The guest awaits a message (future `fid`): still waiting after park_after_s, it parks."""
        if self.run.futures.is_open(fid):
            self.run.post(self._park_later, fid)

    def _park_later(self, fid: int) -> None:
        # loop thread; one timer a run, for its latest wait (a busy mailbox makes many)
        if self._park_timer is not None:
            self._park_timer.cancel()
        self._park_timer = self.run.loop.call_later(self.run.limits.park_after_s, self._park_waiting, fid)

    def _park_waiting(self, fid: int) -> None:
        if self.run.futures.is_open(fid) and self._wants_park():
            self.run.client.park()      # a connection closed meanwhile drops it
