"""llama.cpp's server test suite against `pie serve --local`: an outside check of the OpenAI, Anthropic
and Responses APIs.

    python bench/compat.py [--version 0.3.36] [--modules chat_completion,compat_anthropic,...]
                           [--port N] [--verbose] [--out bench/RESULTS.md]

llama.cpp's server tests (`tools/server/tests`) ship inside llama-cpp-python's sdist on PyPI. This
script downloads the sdist once (`pip download`) into $PIE_HOME/cache/compat, unpacks
the tests next to it, starts `pie serve --local` on a free port and runs the chosen modules with the
suite's own switch for an external server (`DEBUG_EXTERNAL`, `PORT`): its harness then sends every
request to that port instead of starting llama-server. The adaptations, all outside the suite: pie
serve answers to the model names the suite's requests carry (`--served-model-name`, as llama-server
answers to any), and compat_plugin.py sends the suite's bare OpenAI paths (`/chat/completions`) to /v1
and names the model where a request leaves it out. Nothing of the suite is copied into this repository. It prints passed / failed / skipped per
module and one line for each failure.

The suite was written for llama-server on a 260K-parameter test model: tests that match that model's
output, count its prompt tokens or set llama-server's own options read as failures here too. The
per-failure lines tell those from real differences in pie serve's APIs.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from report import add_output_options, publish

from pie_actors.config import pie_home

PACKAGE = "llama-cpp-python"
DEFAULT_VERSION = "0.3.36"
TESTS_IN_SDIST = "vendor/llama.cpp/tools/server/tests"
DEFAULT_MODULES = ("chat_completion", "compat_anthropic", "compat_oai_responses")
# the model names the suite's requests carry; llama-server answers to any name, pie serve to those it is given
SUITE_MODEL_NAMES = ("test", "gpt-4.1", "gpt-3.5-turbo-instruct", "codellama70b")
SERVE_START_S = 600.0  # a first start on a machine may compile the CPU kernels


@dataclass
class ModuleCounts:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (test name, first line of why)


def cache_dir() -> Path:
    return pie_home() / "cache" / "compat"


def fetch_sdist(version: str, cache: Path) -> Path:
    """The sdist of llama-cpp-python `version`, downloaded once by pip (through pip's configured index)."""
    sdist = cache / f"{PACKAGE.replace('-', '_')}-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", str(cache), f"{PACKAGE}=={version}"], check=True)
    return sdist


def unpack_tests(sdist: Path, dest: Path) -> Path:
    """llama.cpp's tools/server/tests out of `sdist`, under `dest`; returns the tests folder."""
    tests = dest / TESTS_IN_SDIST
    if not (tests / "utils.py").exists():
        with tarfile.open(sdist) as tar:
            root = tar.getnames()[0].split("/")[0]
            members = [m for m in tar.getmembers() if m.name.startswith(f"{root}/{TESTS_IN_SDIST}/")]
            for member in members:
                member.name = member.name[len(root) + 1:]
            tar.extractall(dest, members=members, filter="data")
    return tests


def harness_deps(cache: Path) -> Path:
    """A folder with the harness's imports this environment lacks (its utils.py imports `wget`)."""
    deps = cache / "deps"
    if importlib.util.find_spec("wget") is None and not (deps / "wget.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(deps), "wget~=3.2"],
                       check=True)
    return deps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def pie_serve(port: int, log_path: Path) -> Iterator[None]:
    """`pie serve --local` on `port`, until its /health answers 200; stopped on exit."""
    log = open(log_path, "w")
    names = [arg for name in SUITE_MODEL_NAMES for arg in ("--served-model-name", name)]
    process = subprocess.Popen([sys.executable, "-m", "pie_actors.cli", "serve", "--local", "--port", str(port), *names],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVE_START_S
        while not healthy(port):
            if process.poll() is not None:
                raise RuntimeError(f"pie serve exited ({process.returncode}); see {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pie serve did not answer /health in {SERVE_START_S:.0f} s; see {log_path}")
            time.sleep(0.5)  # polling interval of the readiness check
        yield
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def run_suite(tests: Path, modules: list[str], port: int, deps: Path, report: Path, verbose: bool) -> None:
    """The suite's modules against the server on `port`, through its external-server switch."""
    path = (str(deps), str(Path(__file__).parent), os.environ.get("PYTHONPATH"))
    env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port), "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    files = [f"unit/test_{m}.py" for m in modules]
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "compat_plugin", "-p", "no:asyncio",
                    "-q" if verbose else "-qq",
                    "--tb=line" if verbose else "--tb=no", f"--junitxml={report}", *files],
                   cwd=tests, env=env, stdout=None if verbose else subprocess.DEVNULL)


def counts_by_module(report: Path) -> dict[str, ModuleCounts]:
    """passed / failed / skipped per module, from pytest's JUnit XML."""
    counts: dict[str, ModuleCounts] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        entry = counts.setdefault(module, ModuleCounts())
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            entry.passed += 1
        elif outcome.tag == "skipped":
            entry.skipped += 1
        else:
            entry.failed += 1
            why = (outcome.get("message") or outcome.text or "").strip().splitlines()
            entry.failures.append((case.get("name", ""), why[0][:200] if why else ""))
    return counts


def table(counts: dict[str, ModuleCounts]) -> str:
    rows = [f"| {'module':<28} | passed | failed | skipped |", f"|{'-' * 30}|--------|--------|---------|"]
    for module, c in counts.items():
        rows.append(f"| {module:<28} | {c.passed:>6} | {c.failed:>6} | {c.skipped:>7} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python release to take the suite from")
    parser.add_argument("--modules", default=",".join(DEFAULT_MODULES),
                        help="test modules of tools/server/tests/unit, without test_ and .py")
    parser.add_argument("--port", type=int, default=0, help="pie serve's port (default: a free one)")
    parser.add_argument("--verbose", action="store_true", help="pytest's own output and pie serve's log path")
    add_output_options(parser, "llama.cpp's server tests against pie serve")
    args = parser.parse_args()

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist(args.version, cache)
    tests = unpack_tests(sdist, cache / f"{PACKAGE}-{args.version}")
    deps = harness_deps(cache)
    port = args.port or free_port()
    report = cache / "report.xml"
    log = cache / "pie_serve.log"
    if args.verbose:
        print(f"suite: {tests}\npie serve log: {log}")
    with pie_serve(port, log):
        run_suite(tests, args.modules.split(","), port, deps, report, args.verbose)
    counts = counts_by_module(report)
    failures = [f"- `{module}::{name}`: {why}" for module, c in counts.items() for name, why in c.failures]
    env = (f"llama.cpp's tools/server/tests from {PACKAGE} {args.version}'s sdist, modules {args.modules}, "
           "against pie serve --local (the default model and config)")
    publish(env, table(counts) + ("\n\nFailures, each with the first line of its reason:\n\n" + "\n".join(failures)
                                  if failures else ""), args.out, args.title)


if __name__ == "__main__":
    main()
