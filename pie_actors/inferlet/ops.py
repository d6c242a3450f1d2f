"""The host of one inferlet run: `InferletHost`, the HostApi behind the guest SDK's calls.

It builds the run's `RunState` (run_state.py: the engine connection, futures, tokenizer...) and
one glue object per host interface on it, and dispatches each guest call through the one table
of their ops built here. What the run streams (`session.send`, `session.send_file`) goes to
`emit` as events.

Host operations (the guest SDK's calls; see sdk/inferlet/), by glue class:
    model.info / model.encode / model.decode                          ModelOps      (model_ops.py)
    chat.*                                                            ChatOps       (chat_ops.py)
    grammar.*, tools.*, reasoning.*                 GrammarOps, ToolOps, ReasoningOps (structured_ops.py)
    ws.*, eta.program / submit / run_ahead..., chan.*                 EtaOps        (eta_ops.py)
    session.receive / receive_from / receive_file / send_file / file / send_to     SessionOps (session_ops.py)
    runtime.spawn / result / kill / name                              SpawnOps      (spawn_ops.py)
    http.fetch                                                        HttpOps       (http_ops.py)
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from ..gpu.engine.wire import EngineAddress
from ..launch import Launch
from ..process import Event, Send
from .chat_ops import ChatOps
from .eta_ops import EtaOps
from .host import HostApi, InferletError
from .http_ops import HttpOps
from .model_ops import ModelOps
from .peers import Peers
from .run_state import EngineChoice, RunState
from .session_ops import SessionOps
from .spawn_ops import SpawnOps
from .structured_ops import GrammarOps, HandleTable, ReasoningOps, ToolOps

__all__ = ["InferletHost", "op_table"]

HostOp = Callable[[Any], Any]


class HostGlue(Protocol):
    """One host interface: its ops by the name the guest SDK calls them."""

    def ops(self) -> dict[str, HostOp]: ...


def op_table(*glues: HostGlue) -> dict[str, HostOp]:
    """The ops of all `glues` in one table; two interfaces claiming one name is a bug."""
    table: dict[str, HostOp] = {}
    for glue in glues:
        for name, op in glue.ops().items():
            if name in table:
                raise ValueError(f"host operation {name!r} is defined by both "
                                 f"{type(table[name].__self__).__name__} and {type(glue).__name__}")
            table[name] = op
    return table


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
            self.eta = EtaOps(self.state, owner)
            handles = HandleTable()     # one table: tools.grammar makes grammars for grammar.matcher
            self._ops = op_table(
                ModelOps(self.state), ChatOps(self.state), GrammarOps(self.state, handles),
                ToolOps(self.state, handles), ReasoningOps(self.state, handles), self.eta, self.session,
                self.spawn, HttpOps(self.state))
        except BaseException:
            self.state.close()
            raise

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
            self.eta.guest_waits()
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
