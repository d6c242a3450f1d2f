"""The inferlet's asyncio event loop.

`asyncio.run` cannot work in the guest (there are no sockets or self-pipes to select on), so
this is a `BaseEventLoop` whose "selector" is the host: each turn of the loop asks the host
which host futures are done (`poll`, when callbacks are ready to run) or blocks inside the
host until one is (`wait-any`, when every task is waiting). Timers (`asyncio.sleep`) become
the timeout of that wait. Everything else (tasks, gather, queues, locks, timeouts) is stock
asyncio.
"""
from __future__ import annotations

import asyncio
import asyncio.base_events

from . import _host


class _HostSelector:
    """Stands in for `selectors.BaseSelector`: `select(timeout)` is the host poll/wait."""

    def select(self, timeout):
        if timeout is not None and timeout <= 0:
            _host.poll()
            return ()
        if not _host._pending and timeout is None:
            raise RuntimeError(
                "deadlock: every task of the inferlet is waiting, and not on anything the host "
                "will complete (no host future pending, no timer scheduled)")
        _host.wait(timeout)
        return ()

    def close(self):
        pass


class HostEventLoop(asyncio.base_events.BaseEventLoop):
    def __init__(self):
        super().__init__()
        self._selector = _HostSelector()

    def _process_events(self, event_list):
        pass  # the selector has already resolved the host futures

    def _write_to_self(self):
        pass  # single-threaded: nothing to wake up


def _install_policy() -> None:
    """Make `asyncio.new_event_loop` (hence `asyncio.run`) create a HostEventLoop. Policies are
    deprecated in 3.14; where they are gone, only `asyncio.run` without a loop_factory fails."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            class _Policy(asyncio.DefaultEventLoopPolicy):
                def new_event_loop(self):
                    return HostEventLoop()

            asyncio.set_event_loop_policy(_Policy())
        except Exception:
            pass


_install_policy()


def new_loop() -> HostEventLoop:
    """A fresh HostEventLoop, made the current loop (futures created by module-level code
    before `main` runs belong to it)."""
    loop = HostEventLoop()
    asyncio.set_event_loop(loop)
    return loop
