"""Two Ray nodes on this machine for the cluster tests, and the programs they run."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import ray
from ray.cluster_utils import Cluster

from pie_actors import cpu_cores
from pie_actors.controller import NAMESPACE

# greedy decoding of token ids, each new token also streamed (session.send)
GREEDY = """
from inferlet import session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    tokens, ws, pipe, done = list(input["prompt"]), WorkingSet(), Pipeline(), 0
    for _ in range(input["n"]):
        fwd = ForwardPass()
        fwd.embed(tokens[done:])
        fwd.state([ws], StateGeometry.folding())
        out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await out)
        session.send(str(tokens[-1]))
    pipe.close()
    return {"tokens": tokens[len(input["prompt"]):]}
"""
# prefills its prompt into a working set it holds, says "ready", and waits for a message
WAITER = """
from inferlet import session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(list(input["prompt"]))
    fwd.state([ws], StateGeometry.folding())
    first = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    await first
    session.send("ready")
    return {"got": await session.receive()}
"""
# GREEDY's tokens, decoded on the engine (run_ahead): its channels and epilogue are made before its
# first pass, so a run whose engine that pass chooses sends them only then
FED = """
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics,
                          reduce_argmax, reshape)

async def main(input):
    ws, pipe, tokens, n = WorkingSet(), Pipeline(), [], input["n"]
    token_in, token_out = Channel([1], dtype.i32), Channel([1], dtype.i32).capacity(8)

    def pick():
        chosen = reshape(reduce_argmax(intrinsics.output(0, "logits")), [1])
        token_in.put(chosen)
        token_out.put(chosen)

    first = ForwardPass()
    first.embed(list(input["prompt"]))
    first.state([ws], StateGeometry.folding())
    first.epilogue(pick)
    pipe.submit(first)
    tokens.append(await token_out.take_scalar())
    step = ForwardPass()
    step.embed(token_in, Channel.from_([0, 1], dtype.u32))
    step.state([ws], StateGeometry.folding())
    step.epilogue(pick)

    async def on_token():
        tokens.append(await token_out.take_scalar())
        return len(tokens) < n

    await pipe.run_ahead(step, n - 1, on_token)
    pipe.close()
    return {"tokens": tokens}
"""
# prefills its prompt, says "ready" and holds its working set until told to go on, then greedy-decodes
HOLDER = """
from inferlet import runtime, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    if input.get("restartable"):
        runtime.declare_restartable()
    tokens, ws, pipe, done = list(input["prompt"]), WorkingSet(), Pipeline(), 0
    for i in range(input["n"]):
        fwd = ForwardPass()
        fwd.embed(tokens[done:])
        fwd.state([ws], StateGeometry.folding())
        out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await out)
        if i == 0:
            session.send("ready")
            await session.receive()
    pipe.close()
    return {"tokens": tokens[len(input["prompt"]):]}
"""


# The control plane's tests: a dummy engine of one thread, which takes no core of its own (pin_cores:
# it would sit idle while dozens of host actors start on the one left; test_cpu_cores.py pins it).
DUMMY = dict(model="dummy", device="cpu", dtype="float32", compile="off", num_pages=256, num_threads=1,
             pin_cores=False)


def every_core() -> None:
    """This process's threads back on every core it started with: cpu_cores.py moves them off a CPU
    engine's, and what it starts next (a cluster's processes) would inherit that."""
    if cpu_cores.SUPPORTED:
        cpu_cores._move_threads(cpu_cores.ALLOWED)
        cpu_cores._kept_off = cpu_cores.ALLOWED


@contextmanager
def two_nodes() -> Iterator[tuple[Cluster, dict[str, str], object]]:
    """(the Cluster, node ids by letter, node b's handle): node "a" is the head, "b" a worker, one
    CPU each, told apart by a custom resource; this process is its driver (namespace "pie")."""
    every_core()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                            "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        ids = {key[-1]: n["NodeID"] for n in ray.nodes() for key in n["Resources"] if key in ("node_a", "node_b")}
        yield cluster, ids, worker
    finally:
        ray.shutdown()
        cluster.shutdown()


def ready(processes) -> None:
    """Until each of `processes` (HOLDER, WAITER) has said "ready"."""
    for p in processes:
        assert next(p.events(timeout=300)).text == "ready"


def until(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@contextmanager
def ray_head(env: dict[str, str], dashboard: bool = False) -> Iterator[tuple[dict[str, str], int | None]]:
    """A head started as `ray start --head` is, yielding (the env that finds it, the dashboard's port
    or None). Its ports are free ones and its temp dir its own (`RAY_TMPDIR`), so its address file is
    found only by commands given that env, and no other cluster on the machine is touched. `--block`
    keeps the head's processes in a process group of their own, killed together at the end (not
    `ray stop`, which stops every cluster on the machine)."""
    gcs, dash, agent, agent_grpc, runtime_env, metrics, client = free_ports(7)
    temp = tempfile.mkdtemp(prefix="pie-ray-", dir="/tmp")      # short: Ray's socket paths live under it
    env = dict(env, RAY_TMPDIR=temp, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    log = Path(temp) / "head.log"
    bin_dir = Path(sys.executable).parent
    with open(log, "w") as out:
        head = subprocess.Popen(
            [str(bin_dir / "ray"), "start", "--head", "--block", "--num-cpus", "2", f"--port={gcs}",
             f"--include-dashboard={str(dashboard).lower()}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
             f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
             f"--metrics-export-port={metrics}", f"--ray-client-server-port={client}"],
            env=env, cwd=temp, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        until(lambda: head.poll() is not None or "Ray runtime started" in log.read_text(), timeout=120)
        assert head.poll() is None, f"ray start --head exited: {log.read_text()[-2000:]}"
        yield env, dash if dashboard else None
    finally:
        if head.poll() is None:        # the head's own processes, all of them at once (no 30 s drain)
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(60)
        shutil.rmtree(temp, ignore_errors=True)


def run_job(dashboard: int, working_dir: Path, entrypoint: str, timeout: float = 300) -> str:
    """`ray job submit --working-dir working_dir -- entrypoint` through the job SDK on the head whose
    dashboard listens on `dashboard`: the job's logs, once it has succeeded."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    address, deadline = f"http://127.0.0.1:{dashboard}", time.monotonic() + 120
    while True:                       # the dashboard may still be starting
        try:
            jobs = JobSubmissionClient(address)
            break
        except (ConnectionError, RuntimeError):
            assert time.monotonic() < deadline, "the dashboard did not come up"
            time.sleep(1)
    job = jobs.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(working_dir)})
    deadline = time.monotonic() + timeout
    while (status := jobs.get_job_status(job)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.monotonic() < deadline, f"the job did not end: {jobs.get_job_logs(job)[-3000:]}"
        time.sleep(1)
    logs = jobs.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    return logs
