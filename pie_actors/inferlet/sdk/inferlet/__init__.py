"""inferlet: the guest SDK, importable by inferlets running in the pie sandbox.

Only modules imported here (or by the runner entry module) at build time exist at run time,
so every SDK module is imported eagerly. None of them may call the host at import time.
"""
from . import _host, _loop, session, model, chat, eta, grammar, mask, tools, reasoning, runtime, http
from ._host import HostError

__all__ = ["session", "model", "chat", "eta", "grammar", "mask", "tools", "reasoning", "runtime", "http",
           "HostError"]
