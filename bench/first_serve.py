"""A new user's first `pie serve --local`, and their second: how long until it answers.

    python bench/first_serve.py [--out bench/RESULTS.md]

Each start is `pie serve --local` on a new $PIE_HOME that holds only the imported default model
(imported before the clock starts: `pie model import`), so the sandbox's runner component and the
compiled decode packages are built on this machine as a new user's first start builds them. The
second start reuses that $PIE_HOME. For each: seconds until /health answers 200, until the first
chat completion (16 tokens, greedy) has come back, the second request's seconds, and what /health
says of the compiled decode buckets then. Both answers must be the same text.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from report import add_output_options, publish

QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def start(home: Path, pie: str) -> dict:
    """One `pie serve --local` on `home`, timed from its launch to its first two answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    server = subprocess.Popen([pie, "serve", "--local", "--port", str(port)], env={**os.environ, "PIE_HOME": str(home)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"pie serve ended with exit code {server.returncode}")
            try:
                if get(url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)            # polling a server that is starting: there is no event to wait on
        health = time.monotonic() - t0
        ask = {"model": "default", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
               "temperature": 0}
        status, first = get(url + "/v1/chat/completions", ask)
        answered = time.monotonic() - t0
        t1 = time.monotonic()
        _, second = get(url + "/v1/chat/completions", ask)
        again = time.monotonic() - t1
        _, now = get(url + "/health")
    finally:
        server.terminate()
        server.wait(60)
    texts = [reply["choices"][0]["message"]["content"] for reply in (first, second)]
    if status != 200 or texts[0] != texts[1]:
        raise SystemExit(f"the answers differ or failed: {status} {texts}")
    compile = now.get("compile", {})
    return {"health 200 s": round(health, 1), "first answer s": round(answered, 1),
            "second answer s": round(again, 2), "compiled buckets ready / total then":
                f"{compile.get('ready', 0)} / {compile.get('total', 0)}", "answer": texts[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pie", default=str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "pie"))
    add_output_options(ap, "A new user's first pie serve")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="pie-first-serve-"))
    try:
        subprocess.run([args.pie, "model", "import", "smollm2-135m-instruct"], env={**os.environ, "PIE_HOME": str(home)},
                       check=True, capture_output=True)
        load = os.getloadavg()[0]
        rows = {"first start (new $PIE_HOME)": start(home, args.pie), "second start": start(home, args.pie)}
    finally:
        shutil.rmtree(home, ignore_errors=True)
    columns = list(next(iter(rows.values())))
    table = ["| start | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    table += [f"| {name} | " + " | ".join(str(row[c]) for c in columns) + " |" for name, row in rows.items()]
    env = (f"pie serve --local, the default config (engine in a child process, compile \"auto\"); {QUESTION!r}, "
           f"16 tokens, greedy; 1-min load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, "\n".join(table), args.out, args.title)


if __name__ == "__main__":
    main()
