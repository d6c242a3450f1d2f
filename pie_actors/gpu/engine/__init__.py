"""The engine side of the data plane, one concept a file:

    engine.py      Engine: queues passes, runs batches on the workers, epilogues, generate()
    scheduler.py   which pending passes share a batch, their KV slots, run-ahead repeats
    worker.py      one tensor-parallel rank: model shard + KV page tensors; the other ranks' actors
    channels.py    typed queues in engine memory (host <-> device <-> next pass)
    epilogues.py   a pass's epilogue, prologue and adapters, built from the wire
    data_plane.py  EngineServer: the wire protocol over TCP, one connection per inferlet run
    wire.py        the data plane's msgpack frames and message shapes (imports only msgpack)
    actor.py       EngineActor: the engine and its server in a Ray actor

Inferlet hosts import `wire` and must not load torch, so this package's own names load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"Engine": "engine", "Lane": "scheduler", "PassRequest": "scheduler", "PassError": "scheduler",
            "Repeat": "scheduler"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
