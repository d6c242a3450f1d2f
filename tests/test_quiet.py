"""What a user sees is the product's own lines and real errors, not tracebacks of the product's own
shutdown (that it shows none of Ray's notices is checked where `pie run` starts a Ray cluster,
tests/test_cli_run.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

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
