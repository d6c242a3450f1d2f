"""The `ws.*`, `eta.*` and `chan.*` host operations (`EtaOps`): working sets, passes, programs, channels.

It receives the run's `RunState`: the engine connection (`client`, on the loop thread `loop`),
`wait` for blocking calls, and `futures` / `complete` for the guest's asynchronous results.

- Handles of working sets, programs and channels are the run's own small integers, mapped to the
  engine's sequences, program ids and channel ids. Saved working sets (`ws.save`, `ws.open`) are
  named in the scope of the run's `owner`, which the guest cannot choose.
- Epilogues and prologues are eta programs: the guest's traced IR, its channels renamed to the
  engine's, is registered with the engine (compiled once per engine by IR hash).
- A channel the guest reads with `take_scalar` is subscribed: the engine pushes every value put
  into it, so reading a token costs no request, and the guest is handed every value there at once.
- A run whose engine is chosen at its first pass (run_state.EngineChoice) keeps the working sets,
  channels, channel puts and programs it makes before that pass as steps, and sends them once the
  pass has chosen (`_client`): the tokens of that pass's first lane are the prefix the replica is
  chosen by. Any other engine operation before it chooses by load alone.
- Passes are written to the engine in submission order (`RunState.post` is FIFO and
  `EngineClient.start_pass` writes without awaiting); a repeating pass (`run_ahead`) stays on the
  engine, which runs it up to `window` times ahead of the reads the guest acknowledged.
- A run parks (`Pipeline.park`, or `session.receive` still waiting after `limits.park_after_s`)
  once it has no pass in flight, unless it submits one first: the engine lets its working sets
  leave the KV pool first when the pool runs short, and brings them back at its next request on
  one (gpu/engine/saved.py), so the guest never sees it.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections import Counter
from typing import Any, Awaitable, Callable

from .engine_client import EngineClient, EngineError
from .host import HostOpError, Inbox
from .run_state import CONNECT_TIMEOUT_S, RunState

__all__ = ["EtaOps"]

FORK_WAIT_S = 600.0     # how long ws.fork waits for the parent's passes to run (within the run's deadline)
_LANE_KEYS = {"ws", "tokens", "chan", "positions", "slots", "kv_len", "mask", "fold", "readout"}


def _outputs(out: list) -> Any:
    """An epilogue's result for the guest: None, its one output, or the list of them."""
    return None if not out else out[0] if len(out) == 1 else out


def _nothing(out: Any) -> None:
    return None


class EtaOps:
    def __init__(self, run: RunState, owner: str | None = None) -> None:
        self.run, self.owner = run, owner
        self._ws: dict[int, int | None] = {}              # working-set handle -> engine sequence
        self._ws_ids = itertools.count(1)
        self._busy: Counter[int] = Counter()              # working-set handle -> passes not finished
        self._dropped: set[int] = set()                   # handles the guest dropped while busy
        self._busy_cond = threading.Condition()
        self._programs: dict[str, int] = {}               # IR text -> program handle
        self._pids: list[int | None] = [None]             # program handle -> engine program id
        self._puts: dict[int, set[int]] = {}              # program handle -> engine channels it puts into
        self._chan: dict[int, int | None] = {}            # channel handle -> engine channel id
        self._chan_ids = itertools.count(1)
        self._channels: dict[int, Inbox] = {}             # subscribed engine channel -> the values pushed
        self._runs: dict[int, int] = {}                   # run-ahead handle -> its pass request id
        self._stopped: set[int] = set()                   # run-ahead handles the guest stopped
        self._run_ids = itertools.count(1)
        self._held: dict[int, int] = {}                  # engine channel -> values its reads wait for
        self._in_flight = 0                               # passes sent and not finished
        self._told_idle = False                           # the engine knows we wait on something else
        self._park = False                                # to park once no pass is in flight
        self._park_timer: asyncio.TimerHandle | None = None   # parks a run that waits for a message
        # what was made before the engine was chosen, sent in order once it is (`_client`)
        self._steps: list[Callable[[EngineClient], Awaitable[None]]] = []
        self._lost_steps = ""                              # why they were not all sent, if so
        run.on_push = self._on_push
        run.on_receive = self._receiving

    def ops(self) -> dict[str, Callable[[Any], Any]]:
        return {
            "ws.create": self.ws_create, "ws.fork": self.ws_fork, "ws.state": self.ws_state,
            "ws.reserve": self.ws_reserve, "ws.free": self.ws_free, "ws.save": self.ws_save,
            "ws.open": self.ws_open, "ws.saved": self.ws_saved, "ws.delete_saved": self.ws_delete_saved,
            "eta.program": self.program, "eta.submit": self.submit, "eta.run_ahead": self.run_ahead,
            "eta.run_ahead_ack": self.run_ahead_ack, "eta.run_ahead_stop": self.run_ahead_stop,
            "eta.park": self.park,
            "chan.create": self.chan_create, "chan.put": self.chan_put, "chan.put_bits": self.chan_put_bits,
            "chan.take": self.chan_take, "chan.take_scalar": self.chan_take_scalar, "chan.free": self.chan_free,
        }

    # ---- the engine, chosen late ----------------------------------------------------------------

    def _client(self, prefix: list[int] | None = None) -> EngineClient:
        """The engine connection. A run whose engine is not chosen yet chooses it now (by `prefix`,
        the first pass's tokens, when known) and sends what it made meanwhile first."""
        if self.run.bound:
            return self.run.client
        client = self.run.bind(prefix)
        steps, self._steps = self._steps, []

        async def replay() -> None:
            for step in steps:
                await step(client)
        try:
            self.run.wait(replay(), CONNECT_TIMEOUT_S)
        except HostOpError as e:
            self._lost_steps = f"what the run made before its engine was chosen was refused: {e}"
            raise HostOpError(self._lost_steps) from None
        return client

    def _engine_id(self, ids: dict[int, int | None], handle: int, what: str) -> int:
        """`ids[handle]`, the engine's id of the `what` the run calls `handle`; one made before the
        engine was chosen makes the choice now."""
        if ids[handle] is None:
            self._client()
        if ids[handle] is None:
            raise HostOpError(f"{what} {handle} was not made: {self._lost_steps}")
        return ids[handle]

    def _now_or_later(self, step: Callable[[EngineClient], Awaitable[None]]) -> None:
        """Run `step` on the engine now, or, before the engine is chosen, once it is."""
        if self.run.bound:
            self.run.wait(step(self.run.client))
        else:
            self._steps.append(step)

    # ---- working sets -------------------------------------------------------------------------

    def _seq(self, handle: Any) -> int:
        if type(handle) is not int or handle not in self._ws:
            raise HostOpError(f"unknown working set {handle!r}")
        return self._engine_id(self._ws, handle, "working set")

    def _new_ws(self, seq: int | None) -> int:
        handle = next(self._ws_ids)
        self._ws[handle] = seq
        return handle

    def ws_create(self, args: Any) -> int:
        handle = self._new_ws(None)

        async def create(client: EngineClient) -> None:
            if handle in self._ws:                         # not freed meanwhile
                self._ws[handle] = await client.create()
        try:
            self._now_or_later(create)
        except HostOpError:
            del self._ws[handle]
            raise
        return handle

    def ws_fork(self, handle: Any) -> int:
        """A child sharing the prefix the parent has once its passes submitted so far have run."""
        return self._new_ws(self.run.wait(self._client().fork(self._settled(handle, "fork"))))

    def _settled(self, handle: Any, what: str) -> int:
        """The working set's sequence, once the passes submitted on it so far have run."""
        seq = self._seq(handle)
        self.run.flush()                          # the passes to wait for go out first
        with self._busy_cond:
            if not self._busy_cond.wait_for(lambda: not self._busy[handle], self.run.time_left(FORK_WAIT_S)):
                self.run.time_left(FORK_WAIT_S)      # the run's deadline passed: its timeout
                raise HostOpError(f"{what}: the working set's passes did not finish in {FORK_WAIT_S:.0f} s")
        return seq

    def ws_save(self, args: Any) -> int:
        """[handle, name]: keep the working set's frozen prefix, as it is once its passes ran, under
        `name` beyond this run; returns its number of tokens."""
        handle, name = args
        seq = self._settled(handle, "save")
        return self.run.wait(self.run.client.save(seq, name, self.owner))

    def ws_open(self, name: Any) -> dict[str, Any]:
        """A new working set holding the saved set `name`: {"ws", "restored", "tokens"}."""
        opened = self.run.wait(self._client().open(name, self.owner))
        return {"ws": self._new_ws(opened["seq"]), "restored": opened["restored"], "tokens": opened["tokens"]}

    def ws_saved(self, args: Any) -> list[dict]:
        return self.run.wait(self._client().saved(self.owner))

    def ws_delete_saved(self, name: Any) -> None:
        self.run.wait(self._client().delete_saved(name, self.owner))

    def ws_free(self, handles: Any) -> None:
        """The guest dropped these working sets: free each once its passes have run."""
        if not isinstance(handles, list):
            raise HostOpError("ws.free takes a list of working-set handles")
        with self._busy_cond:
            idle = [h for h in handles if h in self._ws and not self._busy[h]]
            self._dropped.update(h for h in handles if h in self._ws and self._busy[h])
        for handle in idle:
            if self._ws[handle] is None:          # never sent to the engine
                del self._ws[handle]
            else:
                self.run.post(self._free_now, handle)

    def _free_now(self, handle: int) -> None:
        # loop thread, FIFO after every pass already submitted on it
        seq = self._ws.pop(handle, None)
        if seq is not None:
            self.run.client.start_free(seq)

    def _hold(self, handles: list[int]) -> None:
        with self._busy_cond:
            self._busy.update(handles)

    def _release(self, handles: list[int]) -> None:
        """A pass on these working sets finished (loop thread)."""
        with self._busy_cond:
            self._busy.subtract(handles)
            free = [h for h in handles if h in self._dropped and not self._busy[h]]
            self._dropped.difference_update(free)
            self._busy_cond.notify_all()
        for handle in free:
            self._free_now(handle)

    def guest_waits(self) -> None:
        """The guest blocks with no pass in flight: it waits on a message, a tool, a timer or its
        client, so the engine's next batch must not wait for it (once per such wait)."""
        with self._busy_cond:
            if self._in_flight or self._told_idle or not self.run.bound:
                return
            self._told_idle = True
        self.run.post(self.run.client.idle)

    # ---- parking ------------------------------------------------------------------------------

    def park(self, args: Any = None) -> None:
        """Pipeline.park: park now, or once the passes in flight have run (unless the guest
        submits another first)."""
        if self._wants_park():
            self.run.post(self.run.client.park)

    def _wants_park(self) -> bool:
        """The run is to park: True when it can at once (bound to its engine, no pass in flight)."""
        with self._busy_cond:
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

    def ws_state(self, handle: Any) -> dict:
        seq = self._seq(handle)
        return self.run.wait(self.run.client.state(seq))

    def ws_reserve(self, args: Any) -> None:
        handle, end = args
        seq = self._seq(handle)
        self.run.wait(self.run.client.reserve(seq, end))

    # ---- programs and passes ------------------------------------------------------------------

    def program(self, ir_text: Any) -> int:
        """Register a traced epilogue/prologue; errors in it are reported here, at trace time (or,
        before the engine is chosen, by the pass that chooses it)."""
        if not isinstance(ir_text, str):
            raise HostOpError("eta.program takes the IR as JSON text")
        handle = self._programs.get(ir_text)
        if handle is None:
            handle = len(self._pids)
            self._pids.append(None)

            async def register(client: EngineClient) -> None:
                engine_ir, self._puts[handle] = self._engine_ir(ir_text)
                self._pids[handle] = await client.program(engine_ir)
            self._now_or_later(register)
            self._programs[ir_text] = handle
        return handle

    def _engine_ir(self, ir_text: str) -> tuple[str, set[int]]:
        """The IR with its channels named by the engine's ids, and the engine channels it puts
        into. IR the engine cannot read goes to it as it is: the engine says what is wrong."""
        try:
            ir = json.loads(ir_text)
            ops = [op for op in ir["ops"] if op[0] in ("take", "put")]
            for op in ops:
                op[1][0] = self._engine_chan(op[1][0])
        except (ValueError, TypeError, KeyError, IndexError):
            return ir_text, set()
        return json.dumps(ir), {op[1][0] for op in ops if op[0] == "put"}

    def _engine_pid(self, handle: Any) -> int | None:
        if handle is None:
            return None
        if type(handle) is not int or not 0 < handle < len(self._pids):
            raise HostOpError(f"unknown program {handle!r} (register it with eta.program)")
        pid = self._pids[handle]
        if pid is None:
            raise HostOpError(f"program {handle} was not registered: {self._lost_steps}")
        return pid

    def _pass_fields(self, args: Any) -> tuple[dict[str, Any], list[int]]:
        """The arguments of `EngineClient.start_pass` for a guest pass {lanes, epilogue, prologue,
        adapters}, and the working-set handles of its lanes."""
        lanes_in = args.get("lanes") if isinstance(args, dict) else None
        if not isinstance(lanes_in, list) or not lanes_in:
            raise HostOpError("a pass needs at least one lane")
        if not self.run.bound:       # the run's first pass; its working sets are all new
            tokens = lanes_in[0].get("tokens") if isinstance(lanes_in[0], dict) else None
            self._client(tokens if isinstance(tokens, list) and tokens else None)
        lanes = []
        for i, lane in enumerate(lanes_in):
            if not isinstance(lane, dict) or lane.keys() - _LANE_KEYS:
                raise HostOpError(f"lane {i}: unknown fields {sorted(set(lane) - _LANE_KEYS)}")
            spec = {k: v for k, v in lane.items() if k not in ("ws", "chan")}
            spec["seq"] = self._seq(lane.get("ws"))
            if lane.get("chan") is not None:
                spec["tokens_from"] = self._engine_chan(lane["chan"])
            lanes.append(spec)
        pid = self._engine_pid(args.get("epilogue"))
        adapters = args.get("adapters") or None
        if adapters is not None:
            if not isinstance(adapters, list) or not all(isinstance(a, list) and len(a) == 2 for a in adapters):
                raise HostOpError("adapters must be a list of [site, program id] pairs")
            adapters = [[site, self._engine_pid(program)] for site, program in adapters]
        fields: dict[str, Any] = {
            "lanes": lanes, "epilogue": {"kind": "argmax"} if pid is None else {"kind": "program", "id": pid},
            "prologue": self._engine_pid(args.get("prologue")), "adapters": adapters}
        return fields, [lane["ws"] for lane in lanes_in]

    def submit(self, args: Any) -> int:
        """Queue a pass; returns the future id of its epilogue's result (None without one)."""
        fields, handles = self._pass_fields(args)
        value = _outputs if args.get("epilogue") is not None else _nothing
        fid = self.run.futures.new()
        self._send_pass(fields, handles, lambda fut: self._pass_done(fid, fut, value))
        return fid

    def _send_pass(self, fields: dict[str, Any], handles: list[int], done: Callable,
                   started: Callable | None = None) -> None:
        """Write the pass request on the loop thread, in submission order; `done(future)` when it
        ends (also when it cannot be sent). Its working sets count as busy until then."""
        self._hold(handles)
        with self._busy_cond:
            self._in_flight += 1
            self._told_idle = self._park = False

        def finished(fut) -> None:
            with self._busy_cond:
                self._in_flight -= 1
                park = self._park and not self._in_flight
            if park:
                self.run.client.park()
            self._release(handles)
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

    def _pass_done(self, fid: int, fut, value: Callable[[Any], Any]) -> None:
        """Complete the guest's future `fid` with `value(result)` of an engine pass request."""
        if fut.cancelled():
            self.run.complete(fid, error="the pass was cancelled")
        elif fut.exception() is not None:
            e = fut.exception()
            self.run.complete(fid, error=f"{e.type}: {e.message}" if isinstance(e, EngineError) else str(e))
        else:
            self.run.complete(fid, value=value(fut.result()))

    # ---- run-ahead ----------------------------------------------------------------------------

    def run_ahead(self, args: Any) -> dict[str, Any]:
        """Start a repeating pass: {"run": handle, "done": future id of the runs kept, "puts": the
        channels its epilogue puts into (what the guest read of them past a stop is dropped)}. With
        `wake_every` n > 1, a read of a channel its epilogue puts into that would wait waits until n
        values are there (or the run is over): the reader is woken once per n tokens, not each."""
        fields, handles = self._pass_fields(args)
        budget, window, wake = args.get("budget"), args.get("window"), args.get("wake_every", 1)
        if type(budget) is not int or type(window) is not int or budget < 1 or window < 1:
            raise HostOpError("run_ahead needs a positive integer budget and window")
        if type(wake) is not int or not 1 <= wake <= window:
            raise HostOpError(f"run_ahead's wake_every must be an integer from 1 to its window ({window})")
        fields["repeat"] = {"budget": budget, "window": window}
        puts = self._puts.get(args.get("epilogue"), set())
        handle, fid = next(self._run_ids), self.run.futures.new()
        for cid in puts:
            self._held[cid] = wake
            if cid in self._channels:
                self._channels[cid].hold(wake)

        def started(request_id: int) -> None:
            self._runs[handle] = request_id

        def done(fut) -> None:
            self._runs.pop(handle, None)
            for cid in puts:                      # no more values come: what is there is all
                if self._held.pop(cid, None) is not None and cid in self._channels:
                    self._channels[cid].hold(1)
            # Once the guest has stopped, what is still unread came from runs past the stop (the
            # engine pushes every value before it answers). A run that ended by its budget keeps
            # its values: the guest may not have read them all yet.
            if handle in self._stopped:
                self._stopped.discard(handle)
                for cid in puts:
                    if cid in self._channels:
                        self._channels[cid].clear()
            self._pass_done(fid, fut, int)

        self._send_pass(fields, handles, done, started)
        return {"run": handle, "done": fid, "puts": [h for h, cid in self._chan.items() if cid in puts]}

    def run_ahead_ack(self, args: Any) -> None:
        """The guest read `read` tokens: the engine may run further ahead (no reply awaited)."""
        handle, read = args
        self.run.post(self._tell_run, handle, lambda pass_id: self.run.client.repeat_ack(pass_id, read))
        self.run.flush()     # at once: the guest may read on without turning its loop (take_scalar)

    def run_ahead_stop(self, args: Any) -> None:
        """Stop the run-ahead; runs after the first `keep` are cut off the working sets."""
        handle, keep = args
        self._stopped.add(handle)
        self.run.post(self._tell_run, handle,
                                           lambda pass_id: self.run.client.repeat_stop(pass_id, keep))

    def _tell_run(self, handle: int, tell: Callable[[int], None]) -> None:
        # loop thread; FIFO after the run's start. A run that ended already needs nothing.
        pass_id = self._runs.get(handle)
        if pass_id is not None:
            tell(pass_id)

    # ---- channels -----------------------------------------------------------------------------

    def _known_chan(self, handle: Any) -> int | None:
        """The engine id of channel `handle`, None while it waits for the engine to be chosen."""
        if type(handle) is not int or handle not in self._chan:
            raise HostOpError(f"channel {handle!r} does not exist (never created by this run, or freed)")
        return self._chan[handle]

    def _engine_chan(self, handle: Any) -> int:
        self._known_chan(handle)
        return self._engine_id(self._chan, handle, "channel")

    def chan_create(self, args: Any) -> int:
        if not isinstance(args, dict):
            raise HostOpError("chan.create takes {shape, dtype, capacity, values}")
        fields = (args.get("shape"), args.get("dtype"), args.get("capacity", 1), args.get("values"))
        handle = next(self._chan_ids)
        self._chan[handle] = None

        async def create(client: EngineClient) -> None:
            if handle in self._chan:                       # not freed meanwhile
                self._chan[handle] = await client.chan_create(*fields)
        try:
            self._now_or_later(create)
        except HostOpError:
            del self._chan[handle]
            raise
        return handle

    def chan_put(self, args: Any) -> None:
        handle, value = args
        self._put(handle, lambda client, cid: client.chan_put(cid, value))

    def chan_put_bits(self, args: Any) -> None:
        """A bool value sent as packed int32 words (bit i % 32 of word i // 32 = element i)."""
        handle, words, n = args
        self._put(handle, lambda client, cid: client.chan_put_bits(cid, words, n))

    def _put(self, handle: Any, put: Callable[[EngineClient, int], Awaitable[None]]) -> None:
        if self._known_chan(handle) in self._channels:
            raise HostOpError(f"channel {handle} is read by the host (take_scalar); the host cannot put into it")

        async def step(client: EngineClient) -> None:
            if handle in self._chan:                       # not freed meanwhile
                await put(client, self._engine_chan(handle))
        self._now_or_later(step)

    def chan_take(self, handle: Any) -> Any:
        cid = self._engine_chan(handle)
        inbox = self._channels.get(cid)
        if inbox is None:
            return self.run.wait(self.run.client.chan_take(cid))
        try:
            return inbox.take()
        except LookupError:
            raise HostOpError(f"channel {handle} is empty (await take_scalar() waits for a value)") from None

    def chan_take_scalar(self, handle: Any) -> dict[str, Any]:
        """{"values": [...]}, every value of the channel that has arrived, when one has; else
        {"future": id} of the values that arrive next (a run-ahead's `wake_every` of them). The
        channel is subscribed on first use. The guest keeps what it is handed and reads on from it
        (the SDK's `Channel.take_scalar`), so a run-ahead loop makes a host call a burst of tokens,
        not one a token."""
        cid = self._chan.get(handle) if type(handle) is int else None
        inbox = self._channels.get(cid)
        if inbox is not None:
            try:
                return {"values": inbox.take(every=True)}
            except LookupError:
                return {"future": inbox.receive(every=True)}
        cid = self._engine_chan(handle)
        inbox = self._channels[cid] = Inbox(self.run.futures)
        inbox.hold(self._held.get(cid, 1))
        fid = inbox.receive(every=True)
        try:
            self.run.wait(self.run.client.chan_subscribe(cid))
        except HostOpError:
            del self._channels[cid]
            raise
        return {"future": fid}

    def _on_push(self, message: dict) -> None:
        """An engine push (loop thread): a value put into a subscribed channel, or its poisoning."""
        inbox = self._channels.get(message.get("chan"))
        if inbox is None:
            return
        if "error" in message:
            inbox.fail(f"the channel is poisoned by a failed pass: {message['error']}")
        else:
            inbox.put(message.get("value"))

    def chan_free(self, handle: Any) -> None:
        cid = self._known_chan(handle)
        del self._chan[handle]
        if cid is not None:
            self._channels.pop(cid, None)
            self.run.wait(self.run.client.chan_free(cid))
