"""Starting other inferlets from an inferlet and awaiting their results.

    worker = await runtime.spawn("worker", {"chunk": text})     # a module of this bundle, or source
    summary = await worker.result()

A child is a process of the same owner with a name (`name=`, or one made up) that
`session.send_to` reaches; it runs in a sandbox of its own. Unless spawned `detached=True`, it
ends when its parent ends, and never outlives the parent's deadline. On a Ray cluster `node=` (a
node id or IP) places it on that node and `model=` runs it on the engine of another model the
cluster serves.
"""
from __future__ import annotations

from . import _host

__all__ = ["spawn", "Child", "name", "declare_restartable"]


class Child:
    """A spawned process: its `name`, `await result()` (main's output; a failed child raises
    HostError with its error) and `kill()`."""

    def __init__(self, cid: int, name: str):
        self._id, self.name = cid, name

    async def result(self):
        return await _host.call_async("runtime.result", self._id)

    def kill(self) -> None:
        _host.call("runtime.kill", self._id)

    def __repr__(self) -> str:
        return f"<Child {self.name!r}>"


def _program(program: str) -> dict:
    # a dotted module name is a module of the bundle; anything else is source text
    if all(part.isidentifier() for part in program.split(".")):
        return {"module": program}
    return {"source": program}


async def spawn(program: str, input=None, *, name: str | None = None, detached: bool = False,
                node: str | None = None, model: str | None = None) -> Child:
    """Start `program` (a module of this inferlet's bundle, by name, or source text) on `input`."""
    info = _host.call("runtime.spawn", {"program": _program(str(program)), "input": input, "name": name,
                                        "detached": bool(detached), "node": node, "model": model})
    return Child(info["id"], info["name"])


def declare_restartable() -> None:
    """This program may run again from its start, on the same input, if its engine is lost under it
    (on a Ray cluster the engine's actor restarts): the run fails as usual, and its launcher starts
    it again, up to `[limits] restarts` times. What it sent before streams again from the start, so
    declare it where a rerun is harmless: greedy decoding gives the same output."""
    _host.call("runtime.declare_restartable")


def name() -> str:
    """This process's name: what other processes' `session.send_to` reach it by."""
    return _host.call("runtime.name")
