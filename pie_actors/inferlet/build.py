"""Building the inferlet components and caching their compiled form.

One *runner* component holds CPython, the guest SDK (sdk/inferlet) and a stdlib subset; an
inferlet's source is handed to it at launch. So are a *bundle*'s files (a folder of pure-Python
files with a main.py) when every stdlib module they import is in the runner (`fits_runner`); a
bundle that needs more gets a component of its own that also holds its files and those modules
(`build_bundle`, behind `pie build DIR`).

componentize-py turns the SDK into a .wasm (~8 s); wasmtime compiles that to machine code
(~5-8 s). Both happen once: the compiled artifact (`Component.serialize()`) is cached, keyed by a hash of everything that shapes it (WIT, SDK sources, the
bundle's files, componentize-py and wasmtime versions, the engine settings, the CPU
architecture), and later loads are a `Component.deserialize_file` of a few milliseconds. Bundles
are cached under $PIE_HOME/cache/inferlet/. The runners depend on the installed package alone,
so they are cached beside it (`runner_dir`): `make setup` builds them there once, and a new
$PIE_HOME does not build them again.
Concurrent builders of the same key (a pool of actors starting together) serialize on a file
lock, so the work is done once.
"""
from __future__ import annotations

import ast
import fcntl
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

from ..config import pie_home
from ..program import Program, parse_python
from .instance_pool import SLOTS, use_pool

HERE = Path(__file__).resolve().parent
WIT_DIR = HERE / "wit"
SDK_DIR = HERE / "sdk"
WORLD = "runner"
ENTRY_MODULE = "pie_runner"
BUNDLE_MODULE = "_pie_bundle"

# Every engine setting that changes compiled code. new_engine() applies exactly these, and they
# are part of the cache key, so a cached artifact always matches the engine that loads it.
ENGINE_SETTINGS: dict[str, object] = {"epoch_interruption": True, "consume_fuel": False}


def new_engine(slots: int = SLOTS):
    """A wasmtime Engine configured as the cached artifacts expect. Its instances take `slots`
    slots of wasmtime's pooling allocator (instance_pool.py: the fast path); 0: no pool, each
    instance's memory is mapped anew and faults in the pages its run writes."""
    import wasmtime

    _keep_guest_traps_catchable()
    config = wasmtime.Config()
    for name, value in ENGINE_SETTINGS.items():
        setattr(config, name, value)
    if slots:
        use_pool(config, slots)
    return wasmtime.Engine(config)


_shared: tuple[int, object] | None = None      # (the process that made it, the engine)
_shared_lock = threading.Lock()


def shared_engine():
    """The process's pooled engine, which every Sandbox uses unless given one: one pool of slots
    for all the components a process runs (each engine reserves a pool's address space)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid():      # a forked child makes its own
            _shared = (os.getpid(), new_engine())
        return _shared[1]


def _keep_guest_traps_catchable() -> None:
    """wasmtime catches a guest's traps (a stack overflow, an out-of-bounds access) in SIGSEGV and
    SIGILL handlers that it installs when its first engine starts, and passes on the faults that
    are not a guest's. A handler installed after it that does not pass them back kills the process
    at the next trap, and `ray.init` installs two: Ray's own failure handler and, when it is not on
    yet, Python's faulthandler. So where Ray has not started in this process yet (in Ray's workers
    its handlers are already below wasmtime's), faulthandler goes on now, below wasmtime's, and a
    later `ray.init` here leaves Ray's handler out."""
    import faulthandler

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return
    if not faulthandler.is_enabled():
        faulthandler.enable()
    if os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1") == "1":
        constants = sys.modules.get("ray._private.ray_constants")     # Ray reads the variable at import
        if constants is not None:
            constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def cache_dir() -> Path:
    return pie_home() / "cache" / "inferlet"


def runner_dir() -> Path:
    """Where the runner components are cached: beside the installed package (under the
    environment's prefix) when it is writable, else $PIE_HOME's cache."""
    folder = Path(sys.prefix) / "share" / "pie_actors" / "runners"
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return folder if os.access(existing, os.W_OK) else cache_dir()


@dataclass
class Artifact:
    """A compiled component on disk, and what it cost to get it."""

    path: Path
    key: str
    from_cache: bool            # True when no build or compile happened in this call
    build_s: float = 0.0        # componentize-py
    compile_s: float = 0.0      # wasmtime compile + serialize
    wasm_bytes: int = 0
    modules: list[str] = field(default_factory=list)   # a bundle's modules
    missing: list[str] = field(default_factory=list)   # imports a bundle needs but cannot have


# ---------------------------------------------------------------------------------------------
# the generated bundle module

Modules = dict[str, tuple[str, bool, str]]      # module name -> (filename, is_package, source)


def _bundle_module_source(files: Modules, preimport: list[str]) -> str:
    lines = ['"""Generated by pie_actors.inferlet.build: the bundle baked into this component."""',
             f"PREIMPORT = {preimport!r}", "FILES = {"]
    for name in sorted(files):
        lines.append(f"    {name!r}: {files[name]!r},")
    lines.append("}")
    return "\n".join(lines) + "\n"


EMPTY_BUNDLE = _bundle_module_source({}, [])


def bundle_modules(files: dict[str, str]) -> Modules:
    """A bundle's .py files (relative path -> text, the entry as main.py: Program.bundle) as modules."""
    modules: Modules = {}
    for rel, source in sorted(files.items()):
        path = Path(rel)
        if path.suffix != ".py" or any(part.startswith(".") or part == "__pycache__" for part in path.parts):
            continue
        parts = list(path.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        if parts and all(p.isidentifier() for p in parts):
            modules[".".join(parts)] = (path.as_posix(), is_package, source)
    if "main" not in modules:
        raise FileNotFoundError("the bundle has no main.py")
    return modules


def runner_modules(program: Program) -> Modules | None:
    """What a runner is handed of `program`'s bundle beside its source (None: no bundle). A
    JavaScript bundle's modules are its files by path, its entry under "main"."""
    if program.bundle is None:
        return None
    if program.language != "javascript":
        return bundle_modules(program.bundle)
    modules: Modules = {path: (path, False, text) for path, text in program.bundle.items() if path != program.entry}
    modules["main"] = (program.entry, False, program.bundle[program.entry])
    return modules


def bundle_imports(modules: Modules) -> tuple[list[str], list[str]]:
    """The stdlib modules the bundle's files import, and the imports that are neither the bundle's
    own nor in the stdlib (they will fail inside the sandbox)."""
    stdlib = set(getattr(sys, "stdlib_module_names", ()))
    local_roots = {name.split(".")[0] for name in modules}
    wanted_stdlib: set[str] = set()
    missing: set[str] = set()
    for filename, _, source in modules.values():
        for target in _imports(source, filename):
            root = target.split(".")[0]
            if root not in local_roots and root != "inferlet":
                (wanted_stdlib if root in stdlib else missing).add(target)
    return sorted(wanted_stdlib), sorted(missing)


def _imports(source: str, filename: str) -> list[str]:
    """The absolute imports of a module's source, as dotted names."""
    targets = []
    for node in ast.walk(parse_python(source, filename)):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets.append(node.module)
    return targets


@functools.cache
def _runner_imports() -> frozenset[str]:
    """Every module the runner's snapshot holds by name: what its entry module imports, with
    the packages above each."""
    entry = SDK_DIR / f"{ENTRY_MODULE}.py"
    names = _imports(entry.read_text(encoding="utf-8"), str(entry))
    return frozenset(".".join(name.split(".")[:i + 1]) for name in names for i in range(name.count(".") + 1))


def fits_runner(files: dict[str, str]) -> bool:
    """Whether a bundle can run on the shared runner, its files handed over at launch: every
    stdlib module it imports is already in the runner's snapshot. A bundle that needs more
    gets a component of its own (`build_bundle`), ~20 s to build once per machine."""
    wanted, _ = bundle_imports(bundle_modules(files))
    return set(wanted) <= _runner_imports()


def _scan_bundle(bundle_dir: Path) -> tuple[Modules, list[str], list[str]]:
    """A bundle folder's modules, the modules to import at build time, and the imports it makes
    that will not exist in the sandbox."""
    program = Program.load(bundle_dir)      # FileNotFoundError: no main.py (nor manifest entry)
    modules = bundle_modules(program.bundle or {"main.py": program.source})
    wanted_stdlib, missing = bundle_imports(modules)
    # stdlib first, then the bundle's own modules (packages before their submodules); main is
    # never imported at build time: it runs at launch, where it may call the host
    own = sorted((n for n in modules if n != "main"), key=lambda n: (n.count("."), n))
    return modules, wanted_stdlib + own, missing


# ---------------------------------------------------------------------------------------------
# hashing, building, compiling

def _versions() -> str:
    return f"componentize-py {metadata.version('componentize-py')}; wasmtime {metadata.version('wasmtime')}"


def _source_files() -> list[Path]:
    out = sorted(WIT_DIR.rglob("*.wit"))
    out += sorted(p for p in SDK_DIR.rglob("*.py") if "__pycache__" not in p.parts)
    return out


def _key(bundle_source: str) -> str:
    h = hashlib.sha256()
    for path in _source_files():
        h.update(path.relative_to(HERE).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    h.update(bundle_source.encode() + b"\0")
    h.update(_versions().encode() + b"\0")
    h.update(repr(sorted(ENGINE_SETTINGS.items())).encode() + b"\0")
    h.update(platform.machine().encode())
    return h.hexdigest()


def componentize(out: Path, bundle_source: str = EMPTY_BUNDLE) -> None:
    """Run componentize-py: SDK + entry module + `bundle_source` -> component at `out`."""
    with tempfile.TemporaryDirectory(prefix="pie-build-") as tmp:
        tmp_path = Path(tmp)
        (tmp_path / f"{BUNDLE_MODULE}.py").write_text(bundle_source, encoding="utf-8")
        # componentize-py adds a virtualenv's site-packages to the guest's path; point it at an
        # empty one so nothing from the host's environment can leak into the component
        fake_venv = tmp_path / "venv"
        (fake_venv / "lib" / "site-packages").mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["VIRTUAL_ENV"] = str(fake_venv)
        cmd = [sys.executable, "-c",
               "import sys; from componentize_py import script; sys.argv[0] = 'componentize-py'; "
               "sys.exit(script())",
               "-d", str(WIT_DIR), "-w", WORLD, "componentize",
               "-p", str(SDK_DIR), "-p", str(tmp_path), ENTRY_MODULE, "-o", str(out)]
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"componentize-py failed (exit {proc.returncode}):\n"
                               f"{proc.stdout}\n{proc.stderr}".strip())


CACHE_KEEP = 8     # compiled components kept on disk (~40 MB each), least recently used go first


def prune_cache(keep: int = CACHE_KEEP, folder: Path | None = None) -> list[Path]:
    """Delete all but the `keep` most recently used artifacts in `folder` (default: the cache
    directory; a hit refreshes its mtime); one being built right now (its lock held) is left
    alone. Returns the deleted paths."""
    artifacts = sorted((folder or cache_dir()).glob("*.cwasm"), key=lambda p: p.stat().st_mtime, reverse=True)
    deleted = []
    for path in artifacts[keep:]:
        with open(path.with_suffix(".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            path.unlink(missing_ok=True)   # a process that loaded it keeps its mapping
            path.with_suffix(".lock").unlink(missing_ok=True)
            deleted.append(path)
    return deleted


def _hit(path: Path, key: str) -> Artifact:
    os.utime(path)                          # most recently used: the last to be pruned
    return Artifact(path, key, from_cache=True)


def _ensure(name: str, key: str, build: Callable[[Path], None], engine=None,
            folder: Path | None = None) -> Artifact:
    """The compiled component `name` under content key `key` in `folder` (default: the cache
    directory); on a miss `build(out)` writes its .wasm to `out`, and wasmtime compiles it."""
    path = (folder or cache_dir()) / f"{name}-{key[:32]}.cwasm"
    if path.is_file():
        return _hit(path, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)        # someone else may be building the same thing
        if path.is_file():
            return _hit(path, key)
        from wasmtime.component import Component

        engine = engine or shared_engine()
        with tempfile.TemporaryDirectory(prefix="pie-wasm-") as tmp:
            wasm = Path(tmp) / f"{name}.wasm"
            t0 = time.perf_counter()
            build(wasm)
            t1 = time.perf_counter()
            component = Component.from_file(engine, str(wasm))
            blob = component.serialize()
            t2 = time.perf_counter()
            wasm_bytes = wasm.stat().st_size
        partial = path.with_name(path.name + f".{os.getpid()}.tmp")
        partial.write_bytes(blob)
        os.replace(partial, path)
    prune_cache(folder=path.parent)
    return Artifact(path, key, from_cache=False, build_s=t1 - t0, compile_s=t2 - t1,
                    wasm_bytes=wasm_bytes)


def ensure_runner(engine=None) -> Artifact:
    """The compiled runner component, built and compiled first if the cache lacks it."""
    return _ensure("runner", _key(EMPTY_BUNDLE), componentize, engine, runner_dir())


def build_bundle(bundle_dir, engine=None) -> Artifact:
    """Make (or find in the cache) the component for a bundle: a folder with main.py and the
    pure-Python modules and packages it imports.

    The bundle's modules other than main, and the stdlib modules its files import, are
    imported at build time and baked into the snapshot; main.py itself runs at launch (pass
    an empty source to Sandbox.run). `missing` lists imports that are neither in the
    bundle nor in the stdlib: they will fail inside the sandbox.
    """
    bundle_dir = Path(bundle_dir).resolve()
    if not bundle_dir.is_dir():
        raise NotADirectoryError(f"{bundle_dir} is not a directory")
    files, preimport, missing = _scan_bundle(bundle_dir)
    bundle_source = _bundle_module_source(files, preimport)
    art = _ensure("bundle", _key(bundle_source), lambda out: componentize(out, bundle_source), engine)
    art.modules = sorted(files)
    art.missing = missing
    return art


# ---------------------------------------------------------------------------------------------
# the JavaScript runner

JS_DIR = HERE / "js"                     # runner.js, the SDK (inferlet.js, sdk/), the pinned componentize-js
JS_BUILD = JS_DIR / "build-runner.mjs"    # componentize-js, with the bindings' string hand-over made native
# WASI left out of the JavaScript runner. Clocks stay: the runner's event loop takes its turns
# with setTimeout, which needs them; so do random (Math.random) and stdio (console.log goes where
# a Python inferlet's print goes).
JS_DISABLED = ("http", "fetch-event")


def _js_sources() -> list[Path]:
    """What the JavaScript runner is built from: the runner, the SDK's modules, the pinned packages."""
    return [JS_DIR / "runner.js", JS_DIR / "inferlet.js", *sorted((JS_DIR / "sdk").glob("*.js")),
            JS_BUILD, JS_DIR / "package-lock.json"]


def _js_key() -> str:
    h = hashlib.sha256()
    for path in sorted(WIT_DIR.rglob("*.wit")) + _js_sources():
        h.update(path.relative_to(HERE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(f"wasmtime {metadata.version('wasmtime')}".encode() + b"\0")
    h.update(repr(sorted(ENGINE_SETTINGS.items())).encode() + b"\0")
    h.update(platform.machine().encode())
    return h.hexdigest()


def componentize_js(out: Path) -> None:
    """Run componentize-js (installed in js/node_modules by `make setup`) through build-runner.mjs:
    runner.js and the SDK it imports -> component at `out`."""
    cli = JS_DIR / "node_modules" / ".bin" / "componentize-js"
    if not cli.is_file():
        raise RuntimeError(f"componentize-js is not installed: run `npm ci` in {JS_DIR} (make setup does)")
    cmd = ["node", str(JS_BUILD), str(JS_DIR / "runner.js"), str(WIT_DIR), WORLD, str(out), *JS_DISABLED]
    proc = subprocess.run(cmd, cwd=JS_DIR, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"componentize-js failed (exit {proc.returncode}):\n"
                           f"{proc.stdout}\n{proc.stderr}".strip())


def ensure_js_runner(engine=None) -> Artifact:
    """The compiled JavaScript runner component, built and compiled first if the cache lacks it."""
    return _ensure("js-runner", _js_key(), componentize_js, engine, runner_dir())
