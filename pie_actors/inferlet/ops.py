"""The host of one inferlet run: `InferletHost`, the HostApi behind the guest SDK's calls.

It builds the run's `RunState` (run_state.py: the engine connection, futures, tokenizer...) and
one glue object per host interface on it (the *_ops.py files), and dispatches each guest call
through the one table of their ops, each behind the check of its arguments (host_op.py). What the
run streams (`session.send`, `session.send_file`) goes to `emit` as events.

Every host operation (the guest SDK's `_host.call(op, args)`, all through the WIT's one
`pie:inferlet/host.call`): its interface, its arguments in their wire form (`value`, `[list]`,
`{object}`; `?` may be left out) and its result, in JSON's terms. Written by `op_table_text()`;
a test keeps it so.

    model.info                   model         - -> dict[str, Any]
    model.encode                 model         text: str -> list[int]
    model.decode                 model         ids: list[int] | TokensAfter -> str
    chat.prefix                  chat          - -> list[int]
    chat.system                  chat          text: str -> list[int]
    chat.user                    chat          text: str -> list[int]
    chat.assistant               chat          text: str -> list[int]
    chat.system_user             chat          [system: str, user: str] -> list[int]
    chat.first_user              chat          text: str -> list[int]
    chat.system_thinking         chat          [text: str, effort: str] -> list[int]
    chat.cue                     chat          - -> list[int]
    chat.cue_without_thinking    chat          - -> list[int]
    chat.cue_thinking            chat          thinking: bool -> list[int]
    chat.seal                    chat          - -> list[int]
    chat.stop_tokens             chat          - -> list[int]
    grammar.compile              grammar       [kind: "json_schema" | "regex" | "ebnf" | "json", source: dict[str, any] | str | null] -> int
    grammar.matcher              grammar       handle: int -> int
    grammar.mask                 grammar       handle: int -> list[int]
    grammar.accept               grammar       [handle: int, tokens: list[int]] -> bool
    grammar.is_terminated        grammar       handle: int -> bool
    grammar.fork                 grammar       handle: int -> int
    grammar.rollback             grammar       [handle: int, n: int] -> null
    grammar.reset                grammar       handle: int -> null
    tools.equip                  tools         {specs: list[dict[str, any]], system?: str | null} -> list[int]
    tools.answer                 tools         [name: str, value: any] -> list[int]
    tools.grammar                tools         specs: list[dict[str, any]] -> int
    tools.decoder                tools         - -> int
    tools.feed                   tools         [handle: int, tokens: list[int]] -> list[dict]
    tools.finish                 tools         handle: int -> list[dict]
    reasoning.decoder            reasoning     tokens: list[int] -> int
    reasoning.feed               reasoning     [handle: int, tokens: list[int]] -> list[dict]
    ws.create                    working-sets  - -> int
    ws.fork                      working-sets  handle: int -> int
    ws.state                     working-sets  handle: int -> dict[str, Any]
    ws.reserve                   working-sets  [handle: int, end: int] -> null
    ws.save                      working-sets  [handle: int, name: str] -> int
    ws.open                      working-sets  name: str -> dict[str, Any]
    ws.saved                     working-sets  - -> list[dict[str, Any]]
    ws.delete_saved              working-sets  name: str -> null
    ws.free                      working-sets  handles: list[int] -> null
    chan.create                  channels      {shape: list[int], dtype: str, capacity?: int, values?: any} -> int
    chan.put                     channels      [handle: int, value: any] -> null
    chan.put_bits                channels      [handle: int, words: list[int], n: int] -> null
    chan.take                    channels      handle: int -> Any
    chan.take_scalar             channels      handle: int -> dict[str, Any]
    chan.free                    channels      handle: int -> null
    eta.program                  passes        ir: str -> int
    eta.submit                   passes        {lanes: list[Lane], epilogue?: int | null, prologue?: int | null, adapters?: list[tuple[str, int]] | null} -> int
    eta.park                     passes        - -> null
    eta.run_ahead                run-ahead     {lanes: list[Lane], epilogue?: int | null, prologue?: int | null, adapters?: list[tuple[str, int]] | null, budget: int, window: int, wake_every?: int} -> dict[str, Any]
    eta.run_ahead_ack            run-ahead     [run: int, read: int] -> null
    eta.run_ahead_stop           run-ahead     [run: int, keep: int | null] -> null
    session.receive              session       - -> int
    session.receive_from         session       - -> int
    session.receive_file         session       - -> int
    session.send_file            session       data: str -> null
    session.file                 session       name: str -> str
    session.send_to              session       [to: str, message: any] -> null
    runtime.declare_restartable  runtime       - -> null
    runtime.name                 runtime       - -> str
    runtime.spawn                runtime       {program: ChildProgram, input?: any, name?: str | null, detached?: bool, node?: str | null, model?: str | null} -> dict[str, Any]
    runtime.result               runtime       handle: int -> int
    runtime.kill                 runtime       handle: int -> null
    http.fetch                   http          {url: str, method?: str | null, headers?: dict[str, str] | null, body?: str | null, timeout?: float | null} -> int

The objects inside them:
    TokensAfter                  {tokens: list[int], after: int}
    Lane                         {ws: int, tokens: list[int], chan?: int | null, positions?: list[int] | null, slots?: list[int] | null, kv_len?: int | null, mask?: list[list[bool]] | null, fold?: bool | int, readout?: list[int] | null, checkpoints?: list[int] | null}
    ChildProgram                 {module?: str, source?: str}
"""
from __future__ import annotations

from typing import Any, Callable

from ..gpu.engine.wire import EngineAddress
from ..launch import Launch
from ..process import Event, Send
from .channel_ops import ChannelOps
from .chat_ops import ChatOps
from .engine_link import EngineLink
from .host import HostApi, InferletError
from .host_op import HostOp, bind, declared, nested_shapes, shape_text
from .http_ops import HttpOps
from .model_ops import ModelOps
from .pass_ops import PassOps
from .peers import Peers
from .run_ahead_ops import RunAheadOps
from .run_state import EngineChoice, RunState
from .session_ops import SessionOps
from .spawn_ops import SpawnOps
from .structured_ops import GrammarOps, HandleTable, ReasoningOps, ToolOps
from .working_set_ops import WorkingSetOps

__all__ = ["InferletHost", "GLUES", "host_ops", "op_table", "op_table_text"]

GLUES = (ModelOps, ChatOps, GrammarOps, ToolOps, ReasoningOps, WorkingSetOps, ChannelOps, PassOps,
         RunAheadOps, SessionOps, SpawnOps, HttpOps)


def host_ops() -> list[HostOp]:
    """Every host operation, declared by the glue classes; two claiming one name is a bug."""
    ops: dict[str, HostOp] = {}
    for glue in GLUES:
        for op in declared(glue):
            if op.name in ops:
                raise ValueError(f"host operation {op.name!r} is declared by both "
                                 f"{ops[op.name].interface!r} and {op.interface!r}")
            ops[op.name] = op
    return list(ops.values())


def op_table(*glues: object) -> dict[str, Callable[[Any], Any]]:
    """The ops of the glue objects `glues`, by name, each behind the check of its arguments."""
    return {op.name: bind(op, glue) for glue in glues for op in declared(type(glue))}


def op_table_text() -> str:
    """The table of every host operation, as this module's docstring shows it."""
    ops = host_ops()
    width = max(len(op.name) for op in ops)
    rows = [f"    {op.name:<{width}}  {op.interface:<12}  {shape_text(op)}" for op in ops]
    rows += ["", "The objects inside them:"]
    rows += [f"    {name:<{width}}  {fields}" for name, fields in nested_shapes(ops).items()]
    return "\n".join(rows)


class InferletHost(HostApi):
    """Host operations of one run of `launch`, connected to the engine at `engine_address` (or to
    the replica an EngineChoice makes at the run's first pass). Its owner is the scope of its saved
    working sets; it reaches the owner's other processes through `peers` (its messages and children;
    None: a run with no process name), and its children may be modules of its program's bundle."""

    def __init__(self, engine_address: EngineAddress | EngineChoice, launch: Launch, *,
                 emit: Callable[[Event], None], peers: Peers | None = None) -> None:
        super().__init__()
        owner = launch.owner
        self.state = RunState(engine_address, futures=self.futures, limits=launch.limits, emit=emit, owner=owner)
        try:
            self.session = SessionOps(self.state, launch.files, peers)
            self.spawn = SpawnOps(self.state, peers, launch.program)
            link = EngineLink(self.state)
            working_sets, channels = WorkingSetOps(link, owner), ChannelOps(link)
            self.passes = PassOps(link, working_sets, channels)
            handles = HandleTable()     # one table: tools.grammar makes grammars for grammar.matcher
            self._ops = op_table(
                ModelOps(self.state), ChatOps(self.state), GrammarOps(self.state, handles),
                ToolOps(self.state, handles), ReasoningOps(self.state, handles), working_sets, channels,
                self.passes, RunAheadOps(self.passes, channels), self.session, self.spawn, HttpOps(self.state))
        except BaseException:
            self.state.close()
            raise
        self.state.on_lost.append(self._engine_lost)

    def _engine_lost(self, reason: str) -> None:
        """A restartable run ends at once when its engine is lost: it runs again from its start, so
        nothing it waits for (a message, say) matters any more."""
        if self.state.restartable:
            self.cancel(reason)

    def call(self, op: str, args: Any) -> Any:
        handler = self._ops.get(op)
        if handler is None:
            return super().call(op, args)      # the "unknown host operation" error
        return handler(args)

    def send(self, message: str) -> None:
        self.state.emit(Send(message))

    def on_loop_turn(self, blocking: bool) -> None:
        """What the host ops posted for the engine goes out now; a guest about to block with no
        pass in flight tells the engine it is idle."""
        if blocking:
            self.passes.guest_waits()
        self.state.flush()

    def deliver(self, message: Any, sender: str | None = None) -> bool:
        """A message for `session.receive` from the client, or from process `sender` (any thread);
        False: the mailbox is full (see SessionOps.deliver)."""
        return self.session.deliver(message, sender)

    def deliver_file(self, data: bytes) -> None:
        """Binary data for `session.receive_file` (any thread)."""
        self.session.deliver_file(data)

    def on_exit(self, error: InferletError | None) -> None:
        """Cancel the children that end with the run, and close the engine connection: the engine
        frees every sequence of the run."""
        try:
            self.spawn.close()
        finally:
            self.state.close()
