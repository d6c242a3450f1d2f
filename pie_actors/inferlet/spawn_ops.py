"""The `runtime.*` host operations (`SpawnOps`): an inferlet starts other inferlets and awaits them.

A child is a process of the parent's owner, started through the launch API by the run's `Peers`
(peers.py: `Runtime.launch` on the cluster, or the local runtime): it has a name that
`session.send_to` reaches and runs in its own sandbox (an actor of its own on a cluster). Its
program is a module of the parent's bundle (run as main, with the bundle's other modules
importable, in the same sandbox) or source text. A child that is not detached lives no
longer than its parent: its deadline is at most the parent's, and it is cancelled when the parent's
run ends, however it ends (`close`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING, Any

from typing_extensions import NotRequired, TypedDict

from ..launch import Launch
from ..program import Program
from .host import HostOpError, InferletError
from .host_op import Handle, host_op, shape
from .peers import Peers
from .run_state import RunState

if TYPE_CHECKING:
    from ..process import Process

__all__ = ["SpawnOps"]


@dataclasses.dataclass
class _Child:
    process: Process
    detached: bool
    result: concurrent.futures.Future       # main's output, read from the child's events


@shape
class ChildProgram(TypedDict):
    module: NotRequired[str]       # a module of this run's bundle
    source: NotRequired[str]       # or the child's source text


@shape
class Spawn(TypedDict):
    program: ChildProgram
    input: NotRequired[Any]
    name: NotRequired[str | None]
    detached: NotRequired[bool]
    node: NotRequired[str | None]
    model: NotRequired[str | None]


class SpawnOps:
    interface = "runtime"

    def __init__(self, run: RunState, peers: Peers | None, program: Program | None) -> None:
        self.run, self.peers, self.program = run, peers, program
        self.children: dict[int, _Child] = {}

    @host_op("runtime.declare_restartable")
    def declare_restartable(self) -> None:
        self.run.restartable = True
        if self.peers is not None:          # its runtime runs it again if its host is lost too
            self.peers.declare_restartable()

    def _peers(self) -> Peers:
        if self.peers is None:
            raise HostOpError("spawning needs named processes: launch the inferlet through the launch "
                              "API (pie run, Runtime.launch)")
        return self.peers

    @host_op("runtime.name")
    def name(self) -> str:
        """This process's name (what other processes' send_to use)."""
        return self._peers().sender

    @host_op("runtime.spawn", Spawn)
    def spawn(self, program: ChildProgram, input: Any = None, name: str | None = None, detached: bool = False,
              node: str | None = None, model: str | None = None) -> dict[str, Any]:
        peers = self._peers()
        limits = self.run.limits
        if not detached:               # a child that ends with its parent needs no later deadline
            limits = dataclasses.replace(limits, timeout_s=self.run.time_left(limits.timeout_s))
        if limits.inferlets and (running := peers.running()) >= limits.inferlets:
            raise HostOpError(f"runtime.spawn: this owner runs {running} inferlets, its bound "
                              "(limits.inferlets; pie serve: [serve.quotas]): wait for one to end")
        try:
            launch = Launch(self._program(program), input or {}, limits=limits,
                            owner=self.run.owner, name=name, node=node)
            process = peers.launch(launch, model=model)
        except (ValueError, KeyError) as e:      # a name in use, an unknown node or model
            raise HostOpError(f"runtime.spawn: {e}") from None
        result = asyncio.run_coroutine_threadsafe(process.aresult(), self.run.loop)
        cid = len(self.children) + 1
        self.children[cid] = _Child(process, detached, result)
        return {"id": cid, "name": process.name}

    def _program(self, spec: ChildProgram) -> Program:
        """The child's program: `source` text, or `module` of this run's bundle, in the parent's
        language (a Python module by dotted name, a JavaScript one by its path, .js optional)."""
        language = self.program.language if self.program is not None else "python"
        if "source" in spec:
            return Program(source=spec["source"], language=language)
        module = spec.get("module")
        if module is None:
            raise HostOpError("runtime.spawn: the program is a module name or source text")
        bundle = self.program.bundle if self.program is not None else None
        if bundle is None:
            raise HostOpError(f"runtime.spawn: no module {module!r}: this inferlet is a single file, not a "
                              "bundle (pass the child's source text, or launch a bundle folder)")
        if language == "javascript":
            path = module.removeprefix("./")
            for rel in (path, f"{path}.js"):
                if rel.endswith(".js") and rel in bundle:
                    return Program(bundle=bundle, language=language, entry=rel)
            names = sorted(bundle)
        else:
            path = module.replace(".", "/")
            for rel in (f"{path}.py", f"{path}/__init__.py"):
                if rel in bundle:
                    return Program(source=bundle[rel], bundle=bundle)   # the bundle's component runs it as main
            names = sorted(r[:-3].replace('/', '.') for r in bundle)
        raise HostOpError(f"runtime.spawn: the bundle has no module {module!r} (modules: {', '.join(names)})")

    def _child(self, handle: int) -> _Child:
        child = self.children.get(handle)
        if child is None:
            raise HostOpError(f"no spawned process {handle!r}")
        return child

    @host_op("runtime.result", Handle)
    def result(self, handle: int) -> int:
        """A future of the child's output; it fails with the child's error."""
        child, fid = self._child(handle), self.run.futures.new()

        def settle(done: concurrent.futures.Future) -> None:
            try:
                self.run.complete(fid, done.result())
            except InferletError as e:
                self.run.complete(fid, error=f"process {child.process.name!r} failed: {e}")
            except (concurrent.futures.CancelledError, RuntimeError) as e:   # the run is closing
                self.run.complete(fid, error=f"process {child.process.name!r}: {type(e).__name__}")

        child.result.add_done_callback(settle)
        return fid

    @host_op("runtime.kill", Handle)
    def kill(self, handle: int) -> None:
        self._child(handle).process.kill(f"killed by its parent {self._peers().sender!r}")

    def close(self) -> None:
        """The run ended: cancel the children that are not detached and still run, and stop
        reading every child's events (the host loop closes next)."""
        for child in self.children.values():
            self.run.tokens += child.process.tokens
            if not child.result.done():
                if not child.detached:
                    child.process.kill(f"its parent {self._peers().sender!r} ended")
                child.result.cancel()
