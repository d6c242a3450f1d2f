"""What a user sees is the product's own lines and real errors: not Ray's notices about its defaults,
and not tracebacks of the product's own shutdown."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Ray's notice that it turned token authentication on (its default for a new local cluster) and the
# one for detached actors in an anonymous namespace
RAY_NOTICES = ("Token authentication is enabled", "anonymous namespace")


def test_pie_run_on_a_new_ray_cluster_prints_no_ray_notices(default_model_dir):
    pie = Path(sys.executable).parent / "pie"
    env = dict(os.environ, PIE_HOME=str(default_model_dir.parent.parent))
    env.pop("RAY_AUTH_MODE", None)                 # Ray's default, as a user has it
    out = subprocess.run([str(pie), "run", "--dtype", "float32", "--compile", "off", "examples/quickstart/main.py",
                          "--", "--question", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout
    assert not [line for line in out.stderr.splitlines() if any(n in line for n in RAY_NOTICES)], out.stderr


# 64 processes, each with a pass done on its engine connection, killed; the runtime closes at once,
# while the data plane still holds their connections
CLOSE_AFTER_KILLS = '''
from pie_actors import Runtime, Send

WAITS = """
from inferlet import session
from inferlet.eta import ForwardPass, Pipeline, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    fwd = ForwardPass()
    fwd.embed([1, 2, 3])
    fwd.state([WorkingSet()])
    token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    Pipeline().submit(fwd)
    await token
    session.send("up")
    await session.receive()
"""

with Runtime.local("dummy", dtype="float32", compile="off", timeout_s=300) as runtime:
    processes = [runtime.launch(WAITS, {}) for _ in range(64)]
    for process in processes:
        assert next(process.events(timeout=300)) == Send("up")
    for process in processes:
        process.kill("done")
    connected = runtime.stats()["connections"]
print(connected)
'''


def test_closing_a_local_runtime_after_killing_its_processes_prints_no_tracebacks():
    out = subprocess.run([sys.executable, "-c", CLOSE_AFTER_KILLS], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 0          # connections were still open when it closed
    assert "Traceback" not in out.stderr and "CancelledError" not in out.stderr, out.stderr[-3000:]
