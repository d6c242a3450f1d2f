"""What a launch runs: an inferlet's main module as source text, or a bundle's Python files.

`Program.load` takes what users hand the launch API: a path to a .py file, a path to a bundle
folder (main.py and its own modules), or the source text itself. A bundle travels as its files'
text, so it can be built into its own sandbox component wherever it runs (an actor on another node).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Program"]


@dataclass(frozen=True)
class Program:
    source: str = ""                         # the main module's text ("" for a bundle: its main.py runs)
    bundle: dict[str, str] | None = None     # a bundle: relative path -> text of each .py file

    @classmethod
    def load(cls, program: str | Path | Program) -> Program:
        """A .py file, a folder with main.py (a bundle when it holds other .py files too), or source
        text (a string with a newline, or one that names no file). FileNotFoundError for a path
        that leads nowhere."""
        if isinstance(program, Program):
            return program
        if isinstance(program, str) and ("\n" in program or not _names_a_file(program)):
            return cls(source=program)
        path = Path(program)
        if path.is_dir():
            main = path / "main.py"
            if main.is_file() and any(f != main for f in path.rglob("*.py")):
                return cls(bundle={str(p.relative_to(path)): p.read_text(encoding="utf-8")
                                   for p in sorted(path.rglob("*.py"))})
            path = main
        if not path.is_file():
            raise FileNotFoundError(f"no inferlet at {program} (a .py file, or a folder with main.py)")
        return cls(source=path.read_text(encoding="utf-8"))

    def bundle_key(self) -> str:
        """A content hash of the bundle's files (where its component is cached)."""
        assert self.bundle is not None
        return hashlib.blake2b(repr(sorted(self.bundle.items())).encode(), digest_size=16).hexdigest()


def _names_a_file(text: str) -> bool:
    return text.endswith((".py", "/")) or Path(text).expanduser().exists()
