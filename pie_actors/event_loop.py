"""The event loop of the product's own loop threads: uvloop's where it is installed (it is a
dependency everywhere but Windows). Both ends of the data plane run one: the engine's server,
and the host loop of a process's runs (inferlet/run_state.py), which handles every token's request
and reply and costs less CPU on uvloop (bench/RESULTS.md, "Speed edits kept")."""
from __future__ import annotations

import asyncio

__all__ = ["new_event_loop"]


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
