"""The Ray cluster a runtime starts for itself runs its workers (the engine's actor, the inferlet
hosts) at the priority of the process that started it: Ray's default of nice 15 lost the engine its
cores to pie serve's own HTTP process."""
from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import os, ray
from pie_actors.runtime import start_ray

assert start_ray()

@ray.remote
class Probe:
    def niceness(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

print(ray.get(Probe.remote().niceness.remote()))
ray.shutdown()
"""


def test_a_cluster_the_runtime_starts_runs_its_actors_at_its_own_priority():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) == os.getpriority(os.PRIO_PROCESS, 0)
