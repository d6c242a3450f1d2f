"""Running inferlets in tests through the launch API (the `runtime` fixture is in conftest)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from pie_actors import File, Runtime, Send

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(runtime: Runtime, source: str, input: Any = None, *, messages: list = (), file_messages: list = (),
        files: dict[str, bytes] | None = None, on_send: Callable[[str], None] | None = None,
        on_send_file: Callable[[bytes], None] | None = None, timeout: float | None = None) -> Any:
    """Launch `source` on `input`; `messages` and `file_messages` are what its session.receive() and
    receive_file() get, in order. Returns its output; raises InferletError."""
    process = runtime.launch(source, {} if input is None else input, files=files, timeout=timeout)
    for message in messages:
        process.send(message)
    for data in file_messages:
        process.send_file(data)
    for event in process.events():
        if isinstance(event, Send) and on_send is not None:
            on_send(event.text)
        elif isinstance(event, File) and on_send_file is not None:
            on_send_file(event.data)
    return process.result()


def idle_stats(runtime: Runtime, timeout: float = 10) -> dict:
    """The engine's stats once no run is connected (a run's connection is released by the engine a
    moment after the run ends)."""
    end = time.monotonic() + timeout
    while (stats := runtime.stats())["connections"] and time.monotonic() < end:
        time.sleep(0.01)
    assert stats["connections"] == 0, stats
    return stats


def referenced(runtime: Runtime) -> int:
    """KV pages referenced by working sets, once every run has let go of its connection."""
    return idle_stats(runtime)["kv"]["referenced"]


def settle(runtime: Runtime, start: int) -> None:
    """Every page the runs took has returned, and the page store's books balance."""
    assert referenced(runtime) == start
    engine = runtime.engine
    with engine._lock:
        engine.kv.check()


def quiet_stats(runtime: Runtime, timeout: float = 60) -> dict:
    """The stats once no process runs and none is connected (on a cluster too: no `engine` here)."""
    end = time.monotonic() + timeout
    while (stats := runtime.stats())["connections"] or stats["processes"]:
        assert time.monotonic() < end, stats
        time.sleep(0.05)
    return stats


@contextmanager
def pages_return(runtime: Runtime) -> Iterator[None]:
    """Around what launches processes (children, peers): once they have all ended, the KV pages
    are where they started."""
    start = quiet_stats(runtime)["kv"]
    yield
    end = quiet_stats(runtime)["kv"]
    assert end["referenced"] == start["referenced"], (start, end)
    assert end["free"] + end["cached"] == start["free"] + start["cached"], (start, end)


def reachable(runtime: Runtime, name: str, message: str = "probe") -> bool:
    """Whether a process named `name` runs (a probe's send_to gets `message` to it)."""
    probe = ("from inferlet import session, HostError\nasync def main(input):\n    try:\n"
             f"        session.send_to({name!r}, {message!r})\n    except HostError:\n        return False\n"
             "    return True\n")
    return runtime.launch(probe, {}).result(300)


@contextmanager
def on_a_cluster(**settings: Any) -> Iterator[Runtime]:
    """`Runtime.connect(**settings)` on a new Ray cluster of this machine (two CPUs), shut down after."""
    import ray

    from pie_actors.controller import NAMESPACE      # the runtime's detached actors live there

    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        with Runtime.connect(**settings) as runtime:
            yield runtime
    finally:
        ray.shutdown()
