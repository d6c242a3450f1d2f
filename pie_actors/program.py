"""What a launch runs: an inferlet's main module as source text, or a bundle's Python files.

`Program.load` takes what users hand the launch API: a path to a .py or .js file, a path to a
bundle folder (main.py and its own modules), or the source text itself (Python's). A .js file is a
JavaScript inferlet: its `language` says which runner runs it. A bundle travels as its files'
text, so it can be built into its own sandbox component wherever it runs (an actor on another node).

A bundle may say what it is in a manifest, `pie.toml` beside its files:

    [bundle]
    name = "summarise"          # required
    version = "0.1.0"           # required
    entry = "agent.py"          # the module that runs (default main.py)

A folder with a manifest is a bundle, and so is any .py file beside the manifest: `pie run main.py`
in the folder (as `ray job submit --working-dir DIR -- pie run main.py` does) runs the whole bundle's entry.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Manifest", "ManifestError", "Program"]

MANIFEST = "pie.toml"


class ManifestError(ValueError):
    """A pie.toml that is not TOML or lacks what a manifest holds; the message names the file."""


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    entry: str = "main.py"        # the bundle's file that runs, relative to its folder

    @classmethod
    def read(cls, folder: Path) -> Manifest | None:
        """The manifest of the bundle in `folder` (None: it has none)."""
        path = folder / MANIFEST
        if not path.is_file():
            return None
        try:
            import tomllib
        except ImportError:                  # Python 3.10
            import tomli as tomllib
        try:
            bundle = tomllib.loads(path.read_text(encoding="utf-8")).get("bundle")
        except tomllib.TOMLDecodeError as e:
            raise ManifestError(f"{path}: {e}") from None
        if not isinstance(bundle, dict) or set(bundle) - {"name", "version", "entry"}:
            raise ManifestError(f"{path}: a [bundle] table of name, version and entry (optional) expected")
        manifest = cls(**{"name": None, "version": None, **bundle})     # missing ones: refused below
        for field in ("name", "version", "entry"):
            if not isinstance(getattr(manifest, field), str) or not getattr(manifest, field):
                raise ManifestError(f"{path}: bundle.{field} must be a non-empty string")
        if not manifest.entry.endswith(".py") or not (folder / manifest.entry).is_file():
            raise ManifestError(f"{path}: bundle.entry {manifest.entry!r} is not a .py file of the bundle")
        if manifest.entry != "main.py" and (folder / "main.py").is_file():   # the entry runs as main.py
            raise ManifestError(f"{path}: the entry is {manifest.entry}, but the bundle has a main.py too "
                                "(rename one)")
        return manifest

    @staticmethod
    def of_file(path: Path) -> Path | None:
        """The bundle folder of a .py file beside a manifest (None: none beside it)."""
        folder = path.resolve().parent
        return folder if (folder / MANIFEST).is_file() else None


@dataclass(frozen=True)
class Program:
    source: str = ""                         # the main module's text ("" for a bundle: its main.py runs)
    bundle: dict[str, str] | None = None     # a bundle: relative path -> text of each .py file
    language: str = "python"                 # "python" or "javascript" (a .js file)

    @classmethod
    def load(cls, program: str | Path | Program) -> Program:
        """A .py or .js file, a folder with main.py (a bundle when it holds other .py files too), or
        Python source text (a string with a newline, or one that names no file). FileNotFoundError for a path
        that leads nowhere."""
        if isinstance(program, Program):
            return program
        if isinstance(program, str) and ("\n" in program or not _names_a_file(program)):
            return cls(source=program)
        path = Path(program)
        if path.is_file() and path.suffix == ".js":
            return cls(source=path.read_text(encoding="utf-8"), language="javascript")
        if path.is_file() and path.suffix == ".py" and (folder := Manifest.of_file(path)) is not None:
            path = folder
        if path.is_dir():
            manifest = Manifest.read(path)
            main = path / (manifest.entry if manifest else "main.py")
            if main.is_file() and (manifest or any(f != main for f in path.rglob("*.py"))):
                return cls(bundle=_bundle_files(path, main))
            path = main
        if not path.is_file():
            raise FileNotFoundError(f"no inferlet at {program} (a .py or .js file, or a folder with main.py)")
        return cls(source=path.read_text(encoding="utf-8"))

    def bundle_key(self) -> str:
        """A content hash of the bundle's files (where its component is cached)."""
        assert self.bundle is not None
        return hashlib.blake2b(repr(sorted(self.bundle.items())).encode(), digest_size=16).hexdigest()


def _bundle_files(folder: Path, entry: Path) -> dict[str, str]:
    """A bundle's .py files by relative path; the entry travels as main.py, the module the
    sandbox runs."""
    files = {str(p.relative_to(folder)): p.read_text(encoding="utf-8") for p in sorted(folder.rglob("*.py"))}
    files["main.py"] = files.pop(str(entry.relative_to(folder)))
    return files


def _names_a_file(text: str) -> bool:
    return text.endswith((".py", ".js", "/")) or Path(text).expanduser().exists()
