"""Running inferlets against a served engine in tests (fixtures `served` and `sandbox` are in conftest)."""
from __future__ import annotations

import time
from pathlib import Path

from pie_actors.inferlet.run import run_inferlet

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def referenced(server) -> int:
    return server.stats()["kv"]["referenced"]


def settle(engine, server, start: int) -> None:
    """KV pages return once the run's connection is closed (the server notices asynchronously)."""
    end = time.monotonic() + 10
    while referenced(server) != start and time.monotonic() < end:
        time.sleep(0.01)
    assert referenced(server) == start
    with engine._lock:
        engine.kv.check()


def run(served, sandbox, source, input=None, **kw):
    """Run `source` on `input` against the served engine; returns the inferlet's output."""
    engine, server = served
    return run_inferlet(source, {} if input is None else input, server.address, sandbox=sandbox, **kw)
