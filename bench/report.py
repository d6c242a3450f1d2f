"""Printing a benchmark's tables and appending them, with the command and date, to a results file."""
from __future__ import annotations

import datetime
import shlex
import sys


def publish(env: str, report: str, out: str | None, title: str) -> None:
    """Print `env` and `report`; with `out`, append them under `## title` with the command line."""
    print(f"\n{env}\n\n{report}")
    if out:
        command = shlex.join(["python", *sys.argv])
        date = datetime.datetime.now().isoformat(timespec="seconds")
        with open(out, "a") as f:
            f.write(f"\n## {title}\n\n`{command}` — {date}\n\n{env}\n\n{report}")
