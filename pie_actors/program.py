"""What a launch runs: an inferlet's main module as source text, or a bundle's Python files.

`Program.load` takes what users hand the launch API: a path to a .py or .js file, a path to a
bundle folder (main.py and its own modules), or the source text itself (Python's). A .js file is a
JavaScript inferlet: its `language` says which runner runs it. A bundle travels as its files'
text, so it can be built into its own sandbox component wherever it runs (an actor on another node).

A JavaScript bundle is a folder of .js modules that import each other (`from "./util.js"`); the
one that runs, its `entry`, is package.json's "main", else main.js, else index.js. A .js file in
a folder with a package.json runs with the folder's other modules beside it.

A bundle may say what it is in a manifest, `pie.toml` beside its files:

    [bundle]
    name = "summarise"          # required
    version = "0.1.0"           # required
    entry = "agent.py"          # the module that runs (default main.py)

A folder with a manifest is a bundle, and so is any .py file beside the manifest: `pie run main.py`
in the folder (as `ray job submit --working-dir DIR -- pie run main.py` does) runs the whole bundle's entry.
"""
from __future__ import annotations

import ast
import hashlib
import json
import threading
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
    entry: str | None = None                 # a JavaScript bundle's module that runs: its path in bundle

    @classmethod
    def load(cls, program: str | Path | Program) -> Program:
        """A .py or .js file, a folder with main.py (a bundle when it holds other .py files too) or a
        JavaScript entry (package.json's "main", main.js, index.js), or Python source text (a string with a newline, or one that names no file). FileNotFoundError for a path
        that leads nowhere."""
        if isinstance(program, Program):
            return program
        if isinstance(program, str) and ("\n" in program or not _names_a_file(program)):
            return cls(source=program)
        path = Path(program)
        if path.is_file() and path.suffix == ".js":
            if (path.parent / PACKAGE_JSON).is_file():
                return _javascript(path.parent, path)
            return cls(source=path.read_text(encoding="utf-8"), language="javascript")
        if path.is_dir() and not (path / "main.py").is_file() and Manifest.read(path) is None:
            entry = _javascript_entry(path)
            if entry is not None:
                return _javascript(path, entry)
        if path.is_file() and path.suffix == ".py" and (folder := Manifest.of_file(path)) is not None:
            path = folder
        if path.is_dir():
            manifest = Manifest.read(path)
            main = path / (manifest.entry if manifest else "main.py")
            if main.is_file() and (manifest or any(f != main for f in path.rglob("*.py"))):
                return cls(bundle=_bundle_files(path, main))
            path = main
        if not path.is_file():
            raise FileNotFoundError(f"no inferlet at {program} (a .py or .js file, or a folder with main.py, "
                                    "package.json, main.js or index.js)")
        return cls(source=path.read_text(encoding="utf-8"))

    def bundle_key(self) -> str:
        """A content hash of the bundle's files (where its component is cached)."""
        assert self.bundle is not None
        return hashlib.blake2b(repr(sorted(self.bundle.items())).encode(), digest_size=16).hexdigest()


PACKAGE_JSON = "package.json"
_PARSE_LOCK = threading.Lock()


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse`, one thread at a time. CPython 3.11 counts the AST constructor's recursion in one
    counter per interpreter, and a parse lets another thread in when a garbage collection inside it
    runs finalizers: two runs starting on their threads at once (a bundle's imports are read at its
    launch) corrupted it, and a launch failed with "SystemError: AST constructor recursion depth
    mismatch"."""
    with _PARSE_LOCK:
        return ast.parse(source, filename)


def _javascript_entry(folder: Path) -> Path | None:
    """A JavaScript bundle folder's entry: package.json's "main", else main.js, else index.js
    (None: none of them, so the folder is no JavaScript bundle)."""
    package = folder / PACKAGE_JSON
    if package.is_file():
        try:
            main = json.loads(package.read_text(encoding="utf-8")).get("main")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{package}: not a JSON object ({e})") from None
        if main is not None:
            entry = folder / str(main)
            if entry.suffix != ".js" or not entry.is_file():
                raise FileNotFoundError(f'{package}: "main" is {main!r}, not a .js file of the folder')
            return entry
    return next((folder / name for name in ("main.js", "index.js") if (folder / name).is_file()), None)


def _javascript(folder: Path, entry: Path) -> Program:
    """The JavaScript program of `entry` in `folder`: its source alone, or with its folder's other
    modules (node_modules and hidden folders left out) when it has any."""
    files = {p.relative_to(folder).as_posix(): p.read_text(encoding="utf-8") for p in sorted(folder.rglob("*.js"))
             if not any(part.startswith(".") or part == "node_modules" for part in p.relative_to(folder).parts)}
    name = entry.relative_to(folder).as_posix()
    if len(files) == 1:
        return Program(source=files[name], language="javascript")
    return Program(bundle=files, language="javascript", entry=name)


def _bundle_files(folder: Path, entry: Path) -> dict[str, str]:
    """A bundle's .py files by relative path; the entry travels as main.py, the module the
    sandbox runs."""
    files = {str(p.relative_to(folder)): p.read_text(encoding="utf-8") for p in sorted(folder.rglob("*.py"))}
    files["main.py"] = files.pop(str(entry.relative_to(folder)))
    return files


def _names_a_file(text: str) -> bool:
    return text.endswith((".py", ".js", "/")) or Path(text).expanduser().exists()
