"""Settings: one frozen, typed `Config`, validated once and passed whole.

A `Config` has four parts: `engine` (EngineConfig: what an engine is built with; the engine and its
data plane get it whole), `limits` (RunLimits: the bounds of every inferlet run, enforced on the host
side), `serve` (ServeConfig: the HTTP front door) and `cluster` (ClusterConfig: how the Controller
places processes on inferlet host actors). Values come from the defaults, then `$PIE_HOME/config.toml`
(sections [engine], [limits], [serve] and [cluster]), then keyword overrides given by name:

    load(dtype="float32", timeout_s=60)      # each name belongs to exactly one part

`pie config init` writes every field with its doc. Imported by processes that must stay light
(inferlet actors, the Controller), so torch is imported only inside `pick_device` / `pick_dtype`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .gpu.model.config import ModelConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
_DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class ConfigError(ValueError):
    """A setting with a wrong type or value; the message names it."""


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"doc": text}, **kw)


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built with. Two engines of one model with different EngineConfigs are
    different engines (the Controller refuses to reuse one for the other)."""

    model: str = _doc("model to serve: a name from `pie model list`, a model folder or a .gguf file",
                      default=DEFAULT_MODEL)
    device: str = _doc('"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"', default="auto")
    dtype: str = _doc('"auto" (bfloat16 where the hardware has it, else float32), "float32", "bfloat16" '
                      'or "float16"', default="auto")
    page_size: int = _doc("tokens per KV-cache page", default=16)
    prefix_cache: bool = _doc("reuse the KV pages of identical prompt prefixes computed before (off: every "
                              "prompt is computed again, for comparisons)", default=True)
    kv_memory_mb: int = _doc("memory for the KV-cache page pool, per worker", default=1024)
    num_pages: int = _doc("KV-cache pages per worker; 0: as many as fit in kv_memory_mb", default=0)
    max_batch_tokens: int = _doc("most tokens one batched forward pass may hold", default=4096)
    tp: int = _doc("tensor-parallel degree (number of workers a model is split over); it must divide "
                   "the model's attention heads, KV heads, MLP width and vocabulary", default=1)
    replicas: int = _doc("engines of this model a Ray cluster runs, one per node while there are nodes "
                         "(GPU nodes on CUDA); each process uses one, its own node's when there is one",
                         default=1)
    compile: str = _doc('run decode batches through compiled graphs: "on", "off", or "auto" (engines that '
                        "serve for long, pie serve's and the cluster's, compile on CUDA and on CPUs with AVX2 "
                        "or better; one-shot runs once their graphs are compiled on this machine). Each "
                        "batch-size bucket compiles once (minutes on a CPU) into a package under "
                        "$PIE_HOME/cache/compiled that later starts load. An engine that serves for long "
                        "serves at once, eager, and compiles its buckets behind, one at a time, each "
                        "running compiled once ready (/health and /metrics show how far); a one-shot "
                        "engine compiles them before its first pass", default="auto")
    compile_max_batch: int = _doc("the largest decode batch (lanes) that runs compiled; larger ones run eager",
                                  default=64)
    num_threads: int = _doc("CPU threads for the model; 0: every core this process may use", default=0)
    pin_cores: bool = _doc("CPU, num_threads below the machine's cores: an engine in a process of its own "
                           "(the cluster's engine actors and ranks, Runtime.local's engine_process) runs its "
                           "model threads on cores of their own, and the runtime's other processes keep off "
                           "them (cpu_cores.py, bench/RESULTS.md)", default=True)
    hugepages: bool = _doc("CPU: weights and KV pages on transparent huge pages (bench/RESULTS.md)",
                           default=True)
    cpu_linear_kernel: bool = _doc("CPU, float32, eager steps: linear layers over a few rows (decode "
                                   "batches, short prefills) run a C++ kernel that reads each weight once, "
                                   "where the BLAS's GEMM falls off from four rows (bench/RESULTS.md)",
                                   default=True)
    amx_gemm_edits: bool = _doc("CPU with AMX, compiled decode: prefetch and cache-hint edits to "
                                "inductor's AMX GEMM template (bench/RESULTS.md); ignored elsewhere",
                                default=True)
    wait_for_programs: bool = _doc("hold the next batch briefly for programs whose passes the last one "
                                   "answered (scheduler.py: keeps one-pass-per-token programs in one batch)",
                                   default=True)
    max_programs: int = _doc("eta programs (traced epilogues) one inferlet run may register", default=4096)
    max_sequences: int = _doc("working sets (sequences) one inferlet run may hold at once, forks included: "
                              "one without KV pages still costs the engine memory", default=4096)
    channel_memory_mb: int = _doc("engine memory all channels together may reserve", default=256)
    spill_memory_mb: int = _doc("host memory for saved working sets evicted from the KV page pool "
                                "(ws.save); a set that does not fit keeps only its tokens and is "
                                "recomputed when opened; 0: never spill", default=1024)

    def __post_init__(self) -> None:
        if isinstance(self.compile, bool):                      # compile=True / False, as a switch
            object.__setattr__(self, "compile", "on" if self.compile else "off")
        _check_types(self, "engine")
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f'engine.device must be "auto", "cpu", "cuda" or "cuda:N", got {self.device!r}')
        if self.dtype not in _DTYPES:
            raise ConfigError(f"engine.dtype must be one of {', '.join(sorted(set(_DTYPES.values())))}, "
                              f"got {self.dtype!r}")
        object.__setattr__(self, "dtype", _DTYPES[self.dtype])
        if self.compile not in ("auto", "on", "off"):
            raise ConfigError(f'engine.compile must be "auto", "on" or "off", got {self.compile!r}')
        _check_min(self, "engine", page_size=1, kv_memory_mb=1, num_pages=0, max_batch_tokens=1, tp=1,
                   num_threads=0, max_programs=1, max_sequences=1, channel_memory_mb=1,
                   compile_max_batch=1, spill_memory_mb=0)
        if not self.model:
            raise ConfigError("engine.model must name a model")
        _check_min(self, "engine", replicas=1)

    def check_model(self, cfg: ModelConfig) -> None:
        """Refuse a tensor-parallel size that does not split the model (before any rank starts: a
        shape that does not split would fail on every rank at once)."""
        for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                        ("intermediate size", cfg.intermediate_size), ("vocabulary size", cfg.vocab_size)):
            if n % self.tp:
                raise ConfigError(f"tensor-parallel size {self.tp} does not divide the model's {what} ({n})")

    def differences(self, other: EngineConfig) -> list[str]:
        """`name=this` vs `other` for each setting that differs, for error messages."""
        return [f"{f.name}={getattr(self, f.name)!r} (asked: {getattr(other, f.name)!r})"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class RunLimits:
    """The bounds of one inferlet run, enforced by its host (the sandbox and its host operations)."""

    timeout_s: float = _doc("wall-clock limit of a run, in seconds", default=300.0)
    memory_mb: int = _doc("the sandbox's linear memory limit per run (the guest's heap)", default=512)
    # wasmtime bounds nothing by default; the runner component needs 14 instances, 2 tables of at
    # most 5,674 elements and 1 memory, whatever the inferlet (its Python code adds none of these)
    table_elements: int = _doc("elements a WebAssembly table of the sandbox may hold", default=65536)
    instances: int = _doc("WebAssembly instances the sandbox may create per run", default=32)
    tables: int = _doc("WebAssembly tables the sandbox may create per run", default=8)
    memories: int = _doc("linear memories the sandbox may create per run (each within memory_mb)", default=1)
    message_mb: int = _doc("the most text, in MiB (2^20 characters), a run hands its host at once: one "
                           "session.send message, or the arguments of one host call (a prompt, a "
                           "session.send_file or session.send_to payload)", default=16)
    run_ahead_window: int = _doc("passes a run_ahead loop keeps in flight beyond what the host has read",
                                 default=8)
    channel_capacity: int = _doc("what model.channel_capacity() tells programs to ask of a channel that "
                                 "buffers a whole decode", default=1024)
    kv_pages: int = _doc("KV pages the working sets of the run's owner may hold together, over all its "
                         "runs; on a hybrid model each recurrent-state slot they hold counts as the pages "
                         "its bytes fill (0: no bound; pie serve sets it per key from [serve.quotas])",
                         default=0)
    inferlets: int = _doc("processes the run's owner may run at once: a runtime.spawn past it is refused "
                          "(0: no bound; pie serve sets it per key from [serve.quotas])", default=0)
    mailbox_size: int = _doc("messages from other processes (session.send_to) a run's mailbox holds before "
                             "senders wait", default=1024)
    send_timeout_s: float = _doc("the longest session.send_to waits for room in a full mailbox (then it "
                                 "fails)", default=30.0)
    allow_hosts: tuple[str, ...] = _doc("hosts http.fetch may reach (names or IPs; \"*\": any public host); "
                                        "none: every request is refused. The cluster's own, loopback and "
                                        "private addresses are refused unless named here", default=())
    http_timeout_s: float = _doc("the longest one http.fetch may take, in seconds", default=30.0)
    http_response_mb: int = _doc("the largest response body http.fetch accepts, in MiB", default=8)
    restarts: int = _doc("times a run that declared itself restartable (runtime.declare_restartable) is "
                         "launched again, on its input, after its engine was lost under it: on a Ray "
                         "cluster, where Ray restarts the engine, and locally (pie serve --local), where "
                         "the engine's child process is started again", default=3)
    park_after_s: float = _doc("seconds a run waits in session.receive with no pass in flight before it "
                               "parks: its working sets are then the first to leave the KV pool when it "
                               "runs short, and come back before its next pass (0: at once)", default=5.0)

    def __post_init__(self) -> None:
        if isinstance(self.allow_hosts, list):
            object.__setattr__(self, "allow_hosts", tuple(self.allow_hosts))
        _check_types(self, "limits")
        if not all(isinstance(h, str) and h for h in self.allow_hosts):
            raise ConfigError("limits.allow_hosts must be a list of host names")
        for name in ("send_timeout_s", "http_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"limits.{name} must be positive, got {getattr(self, name)!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"limits.timeout_s must be positive, got {self.timeout_s!r}")
        _check_min(self, "limits", memory_mb=16, table_elements=1, instances=1, tables=1, memories=1,
                   message_mb=1, run_ahead_window=1, channel_capacity=1, mailbox_size=1, http_response_mb=1, restarts=0)
        _check_min(self, "limits", kv_pages=0, inferlets=0, park_after_s=0)


QUOTA_BOUNDS = ("inferlets", "tokens_per_minute", "kv_pages")     # what [serve.quotas] bounds per key


@dataclass(frozen=True)
class ServeConfig:
    """`pie serve`: where it listens, who may call it, the names of its model, and its endpoints."""

    host: str = _doc("the interface `pie serve` listens on", default="127.0.0.1")
    port: int = _doc("the port of `pie serve` (HTTP and WebSocket)", default=8080)
    api_keys: tuple[str, ...] = _doc("keys a client must send (none: anyone may call; PIE_API_KEYS adds "
                                     "comma-separated keys)", default=())
    served_model_names: tuple[str, ...] = _doc('names the model answers to besides "default" and its '
                                               "store name", default=())
    routes: dict[str, str] = _doc("[serve.routes]: an API route mapped to your own inferlet in place of "
                                  'the built-in one, e.g. "/v1/chat/completions" = "my_chat.py"',
                                  default_factory=dict)
    idle_timeout_s: float = _doc("seconds a process launched over the WebSocket (pie-client) may go with no "
                                 "client attached; then it is ended, its KV pages return", default=600.0)
    detached_buffer: int = _doc("messages a process launched over the WebSocket may send while no client is "
                                "attached; one more ends it (the next attach reads the kept ones, then why)",
                                default=1024)
    stored_responses: int = _doc("responses POST /v1/responses keeps (store: true) for GET and "
                                 "previous_response_id, over all keys; past it the oldest go, with their "
                                 "saved working sets", default=1000)
    default_max_tokens: int = _doc("the most tokens a reply may have when its request gives no max_tokens "
                                   "(chat completions, /v1/responses, Gemini; capped at the context's end; "
                                   "text completions keep OpenAI's 16), so an unbounded request does not "
                                   "hold the engine to the end of the context", default=1024)

    quotas: dict[str, dict[str, int]] = _doc(
        '[serve.quotas]: bounds per API key ("default": every key without its own entry; an entry takes '
        "the default's other bounds), each a table of inferlets (running at once), tokens_per_minute "
        '(prompt and completion) and kv_pages (held at once); 0 or left out: no bound, e.g. default = '
        '{inferlets = 8, tokens_per_minute = 100000}', default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("api_keys", "served_model_names"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        _check_types(self, "serve")
        for name in ("api_keys", "served_model_names"):
            if not all(isinstance(v, str) and v for v in getattr(self, name)):
                raise ConfigError(f"serve.{name} must be a list of non-empty strings")
        if not all(isinstance(k, str) and k.startswith("/") and isinstance(v, str) for k, v in self.routes.items()):
            raise ConfigError('serve.routes maps routes ("/v1/...") to inferlet paths')
        if not 0 <= self.port < 65536:
            raise ConfigError(f"serve.port must be a port number, got {self.port!r}")
        if not self.idle_timeout_s > 0:
            raise ConfigError(f"serve.idle_timeout_s must be positive, got {self.idle_timeout_s!r}")
        _check_min(self, "serve", detached_buffer=0, stored_responses=1, default_max_tokens=1)
        for key, bounds in self.quotas.items():
            if not isinstance(bounds, dict) or not all(
                    name in QUOTA_BOUNDS and type(n) is int and n >= 0 for name, n in bounds.items()):
                raise ConfigError(f"serve.quotas.{key} must be a table of {', '.join(QUOTA_BOUNDS)}, each a "
                                  f"non-negative integer; got {bounds!r}")


@dataclass(frozen=True)
class ClusterConfig:
    """How the Controller of a Ray cluster places processes: many to an inferlet host actor (each its
    own sandbox instance, mailbox, limits and deadline), whose Python process and Ray worker they
    share. The Controller's settings are those of the runtime that started it."""

    inferlets_per_actor: int = _doc("processes one inferlet host actor runs at once (1: an actor process "
                                    "each, as a crash boundary; 128 from the memory and latency measured in "
                                    'bench/RESULTS.md, "Idle sessions on the cluster")', default=128)
    spare_actors: int = _doc("host actors' worth of free room the Controller keeps started ahead of "
                             "launches, so that a burst does not wait for new actor processes", default=1)
    actors_per_node: int = _doc("the most inferlet host actors one node runs: a launch that finds them "
                                "all full fails, naming this bound", default=64)

    def __post_init__(self) -> None:
        _check_types(self, "cluster")
        _check_min(self, "cluster", inferlets_per_actor=1, spare_actors=0, actors_per_node=1)

    @property
    def spare_room(self) -> int:
        """Free room, in processes, kept started ahead of launches."""
        return self.spare_actors * self.inferlets_per_actor


@dataclass(frozen=True)
class Config:
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    limits: RunLimits = dataclasses.field(default_factory=RunLimits)
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)

    def replace(self, **overrides: Any) -> Config:
        """This config with settings replaced by name (`dtype=...`, `timeout_s=...`); validated."""
        parts: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
        for name, value in overrides.items():
            if name not in _SECTION_OF:
                raise ConfigError(f"unknown setting {name!r}; known: {', '.join(sorted(_SECTION_OF))}")
            parts[_SECTION_OF[name]][name] = value
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **parts[section])
                                            for section in _SECTIONS})


_SECTIONS: dict[str, type] = {"engine": EngineConfig, "limits": RunLimits, "serve": ServeConfig,
                              "cluster": ClusterConfig}
_SECTION_OF: dict[str, str] = {}      # setting name -> its section
for _section, _cls in _SECTIONS.items():
    for _f in fields(_cls):
        assert _f.name not in _SECTION_OF, f"setting {_f.name!r} is in two sections"
        _SECTION_OF[_f.name] = _section


def _check_types(obj: Any, section: str) -> None:
    for f in fields(obj):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value, kind = getattr(obj, f.name), type(default)
        if kind is float and type(value) is int:
            object.__setattr__(obj, f.name, float(value))
        elif type(value) is not kind:
            raise ConfigError(f"{section}.{f.name} must be a {kind.__name__}, got {value!r}")


def _check_min(obj: Any, section: str, **minimum: int) -> None:
    for name, low in minimum.items():
        if getattr(obj, name) < low:
            raise ConfigError(f"{section}.{name} must be at least {low}, got {getattr(obj, name)!r}")


# ---- files ---------------------------------------------------------------------------------------

def pie_home() -> Path:
    """$PIE_HOME, else ~/.pie: models, caches and config.toml live here."""
    return Path(os.environ.get("PIE_HOME") or Path.home() / ".pie")


def config_path() -> Path:
    return pie_home() / "config.toml"


def _toml_lines(obj: Any) -> list[str]:
    lines = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, dict):       # a table of its own: documented, left for the user to write
            lines += [f"# {f.metadata['doc']}", ""]
        else:                             # JSON strings, numbers, booleans and lists are valid TOML
            lines += [f"# {f.metadata['doc']}", f"{f.name} = {json.dumps(value)}", ""]
    return lines


def init_config(force: bool = False) -> Path:
    """Write config.toml holding the defaults, each with its doc; refuses to overwrite unless `force`."""
    path = config_path()
    if path.exists() and not force:
        raise FileExistsError(f"{path} already exists (use --force to overwrite it)")
    default = Config()
    lines = ["# pie settings. Delete a line to use its default.", ""]
    for section in _SECTIONS:
        lines += [f"[{section}]", ""] + _toml_lines(getattr(default, section))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _read_file(path: Path) -> dict[str, Any]:
    """config.toml's settings as flat overrides; unknown keys and sections are errors."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise RuntimeError(f"reading {path} on Python < 3.11 needs `pip install tomli`") from None
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from e
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in _SECTIONS and isinstance(value, dict):
            for name, v in value.items():
                if _SECTION_OF.get(name) != key:
                    raise ConfigError(f"{path}: unknown setting {key}.{name}; known in [{key}]: "
                                      f"{', '.join(f.name for f in fields(_SECTIONS[key]))}")
                flat[name] = v
        else:
            where = f" (it belongs in [{_SECTION_OF[key]}])" if key in _SECTION_OF else ""
            raise ConfigError(f"{path}: unknown setting {key!r}{where}")
    return flat


def load(**overrides: Any) -> Config:
    """The settings: defaults, then config.toml when it exists, then `overrides` (by setting name;
    None means "not given"). Raises ConfigError naming the setting on a wrong name, type or value."""
    path = config_path()
    config = Config()
    if path.is_file():
        try:
            config = config.replace(**_read_file(path))
        except ConfigError as e:
            raise ConfigError(str(e) if str(e).startswith(str(path)) else f"{path}: {e}") from None
    return config.replace(**{k: v for k, v in overrides.items() if v is not None})


# ---- device and dtype ----------------------------------------------------------------------------

def pick_device(name: str = "auto") -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`name` as a torch dtype; "auto" is bfloat16 on CUDA and on CPUs with bf16 matrix instructions
    (where it is about twice as fast as float32), float32 elsewhere."""
    import torch

    name = _DTYPES.get(name, name)
    if name != "auto":
        if name not in _DTYPES:
            raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(sorted(set(_DTYPES.values())))}")
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # torch's own dispatch level counts too: ATEN_CPU_CAPABILITY=avx2 runs like an AVX2-only host
    avx512 = torch.backends.cpu.get_cpu_capability().lower() == "avx512"
    return torch.bfloat16 if avx512 and cpu_has("avx512_bf16", "amx_bf16") else torch.float32


def cpu_has(*flags: str) -> bool:
    """Whether the CPU reports any of these /proc/cpuinfo flags (False where there is no cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return bool(set(line.split(":", 1)[1].split()) & set(flags))
    except OSError:  # not Linux: no cheap way to tell, and the plain path is always correct
        pass
    return False
