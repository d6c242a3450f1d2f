"""Printing a benchmark's tables and writing them, with the command, date and host, into a results file.

A results file (bench/RESULTS.md) holds one `## title` section per question; `publish` replaces the
section of its title, so the file always shows the latest run of each question.
"""
from __future__ import annotations

import datetime
import platform
import shlex
import sys
from typing import Any

from pie_actors import cpu_cores

# /proc/cpuinfo flags that decide which CPU kernels run, and how the host line names them
CPU_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}


def host_line() -> str:
    """The machine in one line: CPU model, cores the runtime's processes may use (this one may since
    have moved off a CPU engine's: cpu_cores.py), the CPU_FLAGS it has, the OS, and torch's version
    if torch is already imported (this module never imports it)."""
    model, flags = platform.machine() or "unknown CPU", None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    cores = len(cpu_cores.ALLOWED)
    if flags is None:
        features = "CPU flags unknown"
    else:
        features = " ".join(name for flag, name in CPU_FLAGS.items() if flag in flags) or "no AVX2"
    parts = [model, f"{cores} cores", features, f"{platform.system()} {platform.release()}"]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
    return ", ".join(parts)


def replace_section(path: str, title: str, section: str) -> None:
    """Write `section` in place of the file's `## title` section (up to the next `## ` heading),
    or at the end of the file when it has no such section."""
    try:
        with open(path) as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        lines = []
    heading = f"## {title}"
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        before, after = "".join(lines).rstrip("\n"), ""
        before = before + "\n\n" if before else ""
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        before, after = "".join(lines[:start]), "".join(lines[end:])
    with open(path, "w") as f:
        f.write(before + section + ("\n" + after if after else ""))


def add_output_options(parser: Any, title: str) -> None:
    """The options `publish` takes: --out FILE and --title (default `title`, the bench's section
    of bench/RESULTS.md)."""
    parser.add_argument("--out", metavar="FILE",
                        help="write the tables, command line, date and host as the `## TITLE` section of this "
                             "markdown file (bench/RESULTS.md), replacing the section of that title")
    parser.add_argument("--title", default=title, help="the section's heading (default: %(default)s)")


def publish(env: str, report: str, out: str | None, title: str) -> None:
    """Print `env` and `report`; with `out`, make them the `## title` section of that file (replacing
    the section of that title, or appending it), under the command line, ISO date and host line."""
    print(f"\n{env}\n\n{report}")
    if out:
        command = shlex.join(["python", *sys.argv])
        date = datetime.datetime.now().isoformat(timespec="seconds")
        section = (f"## {title}\n\n`{command}` — {date}\n\nHost: {host_line()}\n\n"
                   f"{env}\n\n{report.rstrip()}\n")
        replace_section(out, title, section)
