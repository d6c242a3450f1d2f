"""Running inferlets from a bench through the launch API, and what the engine did for one run."""
from __future__ import annotations

import time
from typing import Any

from pie_actors import Runtime


def lanes(stats: dict[str, Any]) -> int:
    """Lanes (sequence passes) the engine has executed, from `runtime.stats()`."""
    return sum(int(n) * count for n, count in stats["batch_sizes"].items())


def idle_stats(runtime: Runtime, timeout: float = 60.0) -> dict[str, Any]:
    """`runtime.stats()` once no program holds a connection to the engine, so every frame of the
    runs that ended has been counted."""
    end = time.monotonic() + timeout
    while (stats := runtime.stats())["connections"]:
        if time.monotonic() > end:
            raise TimeoutError(f"the engine still has {stats['connections']} connections after {timeout} s")
        time.sleep(0.001)
    return stats


def run_alone(runtime: Runtime, program: Any, input: Any) -> tuple[Any, dict[str, int]]:
    """Run `program` on `input` with nothing else running: its output, and what the engine did for
    it: {"requests": data-plane frames it sent, "passes": lanes the engine executed}."""
    before = idle_stats(runtime)
    output = runtime.launch(program, input).result()
    after = idle_stats(runtime)
    return output, {"requests": after["requests"] - before["requests"], "passes": lanes(after) - lanes(before)}
