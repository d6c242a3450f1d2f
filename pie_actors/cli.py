"""The `pie` command line, and `pie-client` (programs on a running `pie serve`, over its WebSocket).

Each top-level subcommand is one `_add_<name>(subparsers)` function that builds its parser and sets
`handler` to a small function taking the parsed arguments; to add a subcommand (generate, run,
serve, ...), write such a function and append it to SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from . import config

# Errors that are the user's to fix: printed as one line, not as a traceback.
_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileExistsError, FileNotFoundError)


# --- pie model ------------------------------------------------------------------------------------

def _model_import(args: argparse.Namespace) -> int:
    from .model_store import import_model

    path = import_model(args.source, name=args.name, force=args.force)
    print(f"imported {args.source} as {path.name!r} into {path}")
    return 0


def _model_list(args: argparse.Namespace) -> int:
    from .model_store import list_models, models_dir

    models = list_models()
    if not models:
        print(f"no models in {models_dir()}; add one with `pie model import {config.DEFAULT_MODEL}`")
        return 0
    rows = [("NAME", "ARCH", "PARAMS", "SIZE", "SOURCE")]
    for m in models:
        params = f"{m['params'] / 1e6:.1f}M" if m["params"] is not None else "-"
        rows.append((m["name"], m["architecture"], params, f"{m['size_bytes'] / 2**20:.0f} MiB", m["source"] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return 0


def _add_model(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="manage the local model store")
    actions = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    imp = actions.add_parser("import", help="add a model: a .gguf file, a Hugging Face folder, "
                                            f"{config.DEFAULT_MODEL!r}, or a hub repo id")
    imp.add_argument("source")
    imp.add_argument("--name", help="store name (default: derived from the source)")
    imp.add_argument("--force", action="store_true", help="replace a model of the same name")
    imp.set_defaults(handler=_model_import)
    actions.add_parser("list", help="list stored models").set_defaults(handler=_model_list)


# --- pie config -----------------------------------------------------------------------------------

def _config_init(args: argparse.Namespace) -> int:
    print(f"wrote {config.init_config(force=args.force)}")
    return 0


def _add_config(sub: argparse._SubParsersAction) -> None:
    cfg = sub.add_parser("config", help="manage $PIE_HOME/config.toml")
    actions = cfg.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = actions.add_parser("init", help="write a config file holding the defaults")
    init.add_argument("--force", action="store_true", help="overwrite an existing config file")
    init.set_defaults(handler=_config_init)


# --- the engine's options, for every command that starts one -------------------------------------

def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model name or path (default: the configured model)")
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: config)")
    parser.add_argument("--dtype", help="float32, bfloat16, float16 (default: config)")
    parser.add_argument("--compile", choices=("auto", "on", "off"),
                        help="decode through compiled graphs (default: config, auto: for engines that serve for long)")


def _engine_settings(args: argparse.Namespace) -> dict:
    return {"device": args.device, "dtype": args.dtype, "compile": args.compile}


# --- pie generate ---------------------------------------------------------------------------------

def _generate(args: argparse.Namespace) -> int:
    from .gpu.engine import Engine

    engine = Engine.from_model(args.model or "", **_engine_settings(args))
    tok = engine.tokenizer
    if args.chat:
        if tok.chat_template is None:
            raise ValueError(f"model {engine.model_name!r} has no chat template")
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        text = tok.chat_template.render(messages, add_generation_prompt=True)
    else:
        text = (tok.bos_token or "") * tok.add_bos_token + args.prompt
    reply: list[int] = []
    shown = ""

    def show(_: int, token: int) -> None:
        nonlocal shown
        reply.append(token)
        decoded = tok.decode(reply, skip_special=True)
        print(decoded[len(shown):], end="", flush=True)
        shown = decoded

    engine.generate([tok.encode(text)], args.max_tokens, on_token=show)
    print()
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="greedy completion of one prompt through the engine, streamed")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="format the prompt with the model's chat template")
    gen.add_argument("--system", help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    _add_engine_options(gen)
    gen.set_defaults(handler=_generate)


# --- pie run --------------------------------------------------------------------------------------

def parse_inputs(words: list[str]) -> dict:
    """`--key value` pairs after `--` into the inferlet's input dict. Values are JSON when they
    parse (numbers, booleans, lists), else strings; a `--flag` with no value is True. The `--`
    itself may lead (argparse keeps it where no positional argument comes before)."""
    inputs: dict = {}
    i = 1 if words[:1] == ["--"] else 0
    while i < len(words):
        key = words[i]
        if not key.startswith("--") or len(key) == 2:
            raise ValueError(f"inferlet arguments are --key value pairs; got {key!r}")
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            raw, i = words[i + 1], i + 2
            try:
                inputs[key[2:]] = json.loads(raw)
            except json.JSONDecodeError:
                inputs[key[2:]] = raw
        else:
            inputs[key[2:]], i = True, i + 1
    return inputs


def _attached_files(specs: list[str]) -> dict[str, bytes]:
    """`--file name=path` options into {name: contents} for `session.file(name)`."""
    files = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--file takes name=path, got {spec!r}")
        files[name] = Path(path).read_bytes()
    return files


class _Output:
    """Where a run's session output goes: text to stdout as it arrives, files into a folder. `prog`
    signs what it tells on stderr."""

    def __init__(self, files_dir: str | None, prog: str = "pie"):
        self.streamed = False
        self.files_dir = Path(files_dir) if files_dir else None
        self.files = 0
        self.prog = prog

    def text(self, text: str) -> None:
        self.streamed = True
        print(text, end="", flush=True)

    def file(self, data: bytes) -> None:
        self.files += 1
        if self.files_dir is None:
            print(f"\n{self.prog}: the inferlet sent a file ({len(data)} bytes); keep files with --files-out DIR",
                  file=sys.stderr)
            return
        self.files_dir.mkdir(parents=True, exist_ok=True)
        path = self.files_dir / f"file-{self.files}.bin"
        path.write_bytes(data)
        print(f"\n{self.prog}: wrote {path} ({len(data)} bytes)", file=sys.stderr)

    def follow(self, process) -> int:
        """Print a process's events as they come: its text, its files, then its result as JSON on
        a line of its own. 0, or 1 when it failed."""
        from .process import Done, Failed, File, Send

        for event in process.events():
            if isinstance(event, Send):
                self.text(event.text)
            elif isinstance(event, File):
                self.file(event.data)
            elif isinstance(event, Failed):
                print(f"\n{self.prog}: inferlet failed: {event.error()}", file=sys.stderr)
                return 1
            elif isinstance(event, Done):
                if self.streamed:
                    print()
                print(json.dumps(event.output, ensure_ascii=False))
        return 0


def _run(args: argparse.Namespace) -> int:
    """`pie run`: launch the inferlet through the launch API and print its events as they come."""
    from .program import Program
    from .runtime import Runtime

    program = Program.load(args.file)     # a wrong path is an error now, not after the engine loads
    out = _Output(args.files_out)
    files = _attached_files(args.file_attach)
    inputs = parse_inputs(args.inputs)
    settings = {"model": args.model, **_engine_settings(args), "timeout_s": args.timeout}
    if args.allow_host:           # added to the config's list, for this run
        settings["allow_hosts"] = (*config.load().limits.allow_hosts, *args.allow_host)
    with (Runtime.local if args.local else Runtime.connect)(**settings) as runtime:
        process = runtime.launch(program, inputs, name=args.name, files=files)
        try:
            return out.follow(process)
        except KeyboardInterrupt:
            process.kill()
            raise


def _build(args: argparse.Namespace) -> int:
    from .inferlet.build import build_bundle, bundle_imports, bundle_modules, fits_runner
    from .program import Manifest, Program

    program = Program.load(args.dir)
    if program.language == "javascript":       # its modules are handed to the one JavaScript runner
        listed = f" (modules: {', '.join(sorted(program.bundle))})" if program.bundle else ""
        print(f"a JavaScript program runs on the JavaScript runner: nothing to build{listed}")
        return 0
    files = program.bundle or {"main.py": program.source}
    modules = bundle_modules(files)
    manifest = Manifest.read(Path(args.dir))
    label = f"{manifest.name} {manifest.version}: " if manifest else ""
    if fits_runner(files):
        print(f"{label}runs on the shared runner, nothing to build (modules: {', '.join(sorted(modules))})")
    else:
        art = build_bundle(args.dir)
        print(f"{label}{'cached' if art.from_cache else 'built'} {art.path} (modules: {', '.join(art.modules)})")
    _, missing = bundle_imports(modules)
    if missing:
        print(f"pie: warning: imports neither in the bundle nor in the sandbox's stdlib: "
              f"{', '.join(missing)}", file=sys.stderr)
    return 0


def _add_build(sub: argparse._SubParsersAction) -> None:
    build = sub.add_parser("build", help="check a bundle (a folder with main.py and its pure-Python "
                                         "modules); one that imports stdlib modules the shared runner "
                                         "lacks is built into its own sandbox component")
    build.add_argument("dir")
    build.set_defaults(handler=_build)


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="run an inferlet: pie run [options] main.py -- --key value ...")
    run.add_argument("file", help="the inferlet: a .py file, or a folder with main.py (and its modules)")
    run.add_argument("inputs", nargs=argparse.REMAINDER, help="-- then --key value pairs: the input dict")
    _add_engine_options(run)
    run.add_argument("--timeout", type=float, help="wall-clock limit in seconds (default: config's timeout_s)")
    run.add_argument("--file", dest="file_attach", action="append", default=[], metavar="NAME=PATH",
                     help="attach a file, read in the inferlet with session.file(NAME) (repeatable)")
    run.add_argument("--files-out", metavar="DIR", help="where files the inferlet sends are written")
    run.add_argument("--name", help="process name (for other inferlets' session.send_to)")
    run.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                     help="a host http.fetch may reach in this run, besides [limits] allow_hosts (repeatable)")
    run.add_argument("--local", action="store_true",
                     help="run everything in this process (no Ray): engine, server and sandbox. Default: "
                          "join the Ray cluster at RAY_ADDRESS or on this machine, or start a local one")
    run.set_defaults(handler=_run)


# --- pie serve ------------------------------------------------------------------------------------

def _serve(args: argparse.Namespace) -> int:
    """`pie serve`: the OpenAI, Anthropic and Gemini APIs on one port (pie_actors.serve.Server)."""
    from .serve import Server

    settings = {"host": args.host, "port": args.port, **_engine_settings(args),
                "served_model_names": tuple(args.served_model_name) or None, "api_keys": tuple(args.api_key) or None}
    if args.one_process and not args.local:
        raise SystemExit("pie serve: --one-process goes with --local (on Ray the engine has its own actor)")
    server = Server(args.model, local=args.local, engine_process=not args.one_process,
                    access_log=True, **settings).start()
    names = ", ".join(server.serving.names)
    print(f"pie serve: {server.url} (OpenAI {server.url}/v1, Anthropic and Gemini {server.url}); model "
          f"{server.serving.model}, answering to {names}", flush=True)
    try:
        server.wait_ready()
    except BaseException:
        server.close()
        raise
    print("pie serve: the engine is loaded; serving (Ctrl-C stops)", flush=True)
    server.serve_forever()
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI, Anthropic and Gemini APIs on one port, each request "
                                         "a built-in endpoint inferlet (replaceable in [serve.routes])")
    serve.add_argument("--host", help="interface to listen on (default: config, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: config, 8080)")
    _add_engine_options(serve)
    serve.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                       help='another name the model answers to, besides "default" and its store name (repeatable)')
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="a key clients must send (repeatable; replaces the config's keys; PIE_API_KEYS adds more)")
    serve.add_argument("--local", action="store_true",
                       help="no Ray: the HTTP layer and the programs in this process, the engine in a child "
                            "process of its own (out of the interpreter lock their host work holds). Default: join "
                            "the Ray cluster at RAY_ADDRESS or on this machine, or start a local one")
    serve.add_argument("--one-process", action="store_true",
                       help="with --local: the engine in this process too")
    serve.set_defaults(handler=_serve)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_model, _add_config, _add_generate, _add_run,
                                                                   _add_build, _add_serve]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pie", description="pie: programmable LLM serving")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return _dispatch(build_parser().parse_args(argv), "pie")


# --- pie-client: programs on a running pie serve ---------------------------------------------------

def _connect(args: argparse.Namespace):
    import os

    from .client import Client
    return Client(getattr(args, "url", None) or os.environ.get("PIE_URL") or "http://127.0.0.1:8080",
                  getattr(args, "api_key", None) or os.environ.get("PIE_API_KEY") or None)


def _client_submit(args: argparse.Namespace) -> int:
    """`pie-client submit`: launch on the server and print the events as `pie run` does (Ctrl-C
    kills the process); --detach prints its id instead."""
    out = _Output(args.files_out, "pie-client")
    files = _attached_files(args.file_attach)
    inputs = parse_inputs(args.inputs)
    with _connect(args) as client:
        process = client.submit(args.path, inputs, name=args.name, files=files, timeout=args.timeout,
                                detach=args.detach)
        if args.detach:
            print(process.id)
            return 0
        try:
            return out.follow(process)
        except KeyboardInterrupt:
            process.kill()
            raise


def _client_attach(args: argparse.Namespace) -> int:
    """`pie-client attach`: what the process sent meanwhile, then its next events (Ctrl-C detaches)."""
    with _connect(args) as client:
        process = client.attach(args.process)
        try:
            return _Output(args.files_out, "pie-client").follow(process)
        except KeyboardInterrupt:
            process.detach()
            print(f"\npie-client: detached; `pie-client attach {process.id}` follows it again", file=sys.stderr)
            raise


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _client_ps(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        rows = [("PROCESS", "NAME", "STATE", "ATTACHED", "BUFFERED", "AGE")]
        rows += [(p["process"], p["name"], p["state"], "yes" if p["attached"] else "no", str(p["buffered"]),
                  f"{p['age_s']:.1f}s") for p in client.ps()]
    _print_table(rows)
    return 0


def _client_saved(args: argparse.Namespace) -> int:
    """`pie-client saved`: this key's saved working sets (ws.save), and where each one is."""
    with _connect(args) as client:
        rows = [("NAME", "STATE", "TOKENS")] + [(s["name"], s["state"], str(s["tokens"])) for s in client.saved()]
    _print_table(rows)
    return 0


def _client_delete_saved(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        client.delete_saved(args.name)
    return 0


def _client_send(args: argparse.Namespace) -> int:
    try:
        message = json.loads(args.message)
    except json.JSONDecodeError:
        message = args.message
    with _connect(args) as client:
        client.send(args.process, message)
    return 0


def _client_kill(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        client.kill(args.process)
    return 0


def build_client_parser() -> argparse.ArgumentParser:
    # --url and --api-key go before or after the subcommand (unset ones are left out: _connect)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help="the pie serve to talk to (default: $PIE_URL, else http://127.0.0.1:8080)")
    common.add_argument("--api-key", default=argparse.SUPPRESS, help="its API key (default: $PIE_API_KEY)")
    parser = argparse.ArgumentParser(prog="pie-client", parents=[common],
                                     description="run inferlets on a running pie serve, and talk to them")
    sub = parser.add_subparsers(dest="command", required=True)
    submit = sub.add_parser("submit", parents=[common], help="launch an inferlet: pie-client submit --path main.py "
                                                             "[options] -- --key value ...")
    submit.add_argument("--path", required=True, help="the inferlet: a .py file, or a folder with main.py")
    submit.add_argument("inputs", nargs=argparse.REMAINDER, help="-- then --key value pairs: the input dict")
    submit.add_argument("--file", dest="file_attach", action="append", default=[], metavar="NAME=PATH",
                        help="attach a file, read in the inferlet with session.file(NAME) (repeatable)")
    submit.add_argument("--files-out", metavar="DIR", help="where files the inferlet sends are written")
    submit.add_argument("--name", help="process name (for this key's other inferlets' session.send_to)")
    submit.add_argument("--timeout", type=float, help="wall-clock limit in seconds (default: the server's)")
    submit.add_argument("--detach", action="store_true", help="print the process id and leave it running")
    submit.set_defaults(handler=_client_submit)
    attach = sub.add_parser("attach", parents=[common], help="follow a process: what it sent meanwhile, then "
                                                             "its next events (Ctrl-C detaches)")
    attach.add_argument("process", help="its id")
    attach.add_argument("--files-out", metavar="DIR", help="where files the inferlet sends are written")
    attach.set_defaults(handler=_client_attach)
    sub.add_parser("ps", parents=[common], help="list this key's processes").set_defaults(handler=_client_ps)
    send = sub.add_parser("send", parents=[common], help="send a message to a process's session.receive()")
    send.add_argument("process", help="its id")
    send.add_argument("message", help="text, or JSON")
    send.set_defaults(handler=_client_send)
    kill = sub.add_parser("kill", parents=[common], help="end a process (its KV pages return)")
    kill.add_argument("process", help="its id")
    kill.set_defaults(handler=_client_kill)
    sub.add_parser("saved", parents=[common], help="list this key's saved working sets (ws.save): name, state "
                                                   "(kept, spilled, tokens), tokens").set_defaults(handler=_client_saved)
    delete = sub.add_parser("delete-saved", parents=[common], help="forget a saved working set (its KV pages return)")
    delete.add_argument("name", help="its name")
    delete.set_defaults(handler=_client_delete_saved)
    return parser


def _dispatch(args: argparse.Namespace, prog: str, errors: tuple[type[BaseException], ...] = _USER_ERRORS) -> int:
    try:
        return args.handler(args)
    except errors as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def client_main(argv: list[str] | None = None) -> int:
    from .ws_protocol import RequestError

    # the server's refusals and an unreachable server are one line too
    return _dispatch(build_client_parser().parse_args(argv), "pie-client", (*_USER_ERRORS, RequestError, ConnectionError))


if __name__ == "__main__":
    sys.exit(main())
