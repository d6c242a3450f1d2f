"""`Launch`: what one start of a program is, built once by `Runtime.launch` and passed whole.

The backends, the Controller, the inferlet host actor and `Run` all take the same frozen value; a
name chosen later (by the runtime or the Controller) and a restart are `dataclasses.replace(launch,
...)`. Imported by inferlet actors and the Controller: nothing here imports torch or Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import RunLimits
from .program import Program

__all__ = ["Launch", "ProcessKey"]

ProcessKey = tuple[str | None, str]      # (owner, name): names are per owner


@dataclass(frozen=True)
class Launch:
    """`program` run on `input` (main's argument) with `files` (what `session.file` reads) under
    `limits`, as process `name` of `owner` (None: this machine's user; a name is made up when None),
    on Ray node `node` (an id or IP; None: where the Controller places it)."""

    program: Program
    input: Any = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    limits: RunLimits = field(default_factory=RunLimits)
    owner: str | None = None
    name: str | None = None
    node: str | None = None

    @property
    def key(self) -> ProcessKey:
        """(owner, name): the process's identity (its name is set once launched)."""
        assert self.name is not None, "a launch is named before it runs"
        return self.owner, self.name
