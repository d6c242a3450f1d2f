"""A CPU engine in a process of its own keeps its model thread on cores of its own, and the runtime's
other processes keep off them (pie_actors/cpu_cores.py): a reservation always leaves a core to the
rest, others keep off it while its process lives and come back once it ends; `Runtime.local`'s
engine process pins its model thread, this process keeps off it, and the tokens equal the in-process
engine's; `pin_cores = false` and `num_threads = 0` pin nothing; on a two-node Ray cluster the engine
actor pins its model thread and a host actor running a process keeps off its core."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from pie_actors import Runtime, cpu_cores
from pie_actors.controller import INFERLET_PREFIX
from pie_actors.replicas import ENGINE_PREFIX
from tests.cluster_helpers import DUMMY, GREEDY, HOLDER, every_core, ready, two_nodes

pytestmark = pytest.mark.skipif(len(cpu_cores.ALLOWED) < 2 or not cpu_cores.SUPPORTED,
                                reason="a reservation leaves one core to the rest: pinning needs two, and Linux")
PROMPT, NEW = [1, 504, 3458, 314, 253, 3300, 28], 8
HOLD_ONE = """
import json, sys
from pie_actors import cpu_cores
print(json.dumps(sorted(cpu_cores.reserve(1))), flush=True)
sys.stdin.read()
"""                                 # a process that reserves a core, as an engine's does, until its input ends


def threads(pid: int | str = "self") -> dict[int, frozenset[int]]:
    """Each thread of process `pid` -> the cores it may run on."""
    return {int(t): frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture(autouse=True)
def all_cores():
    """This process's threads on every core again after each test, whatever it pinned."""
    yield
    every_core()


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A registry of this test's own (the machine's may hold a running engine's entry)."""
    monkeypatch.setattr(cpu_cores, "REGISTRY", tmp_path / cpu_cores.REGISTRY.name)
    monkeypatch.setenv("TMPDIR", str(tmp_path))            # where child processes look for it
    return cpu_cores.REGISTRY


def test_a_reservation_leaves_a_core_and_others_keep_off_it_while_its_process_lives(registry):
    child = subprocess.Popen([sys.executable, "-c", HOLD_ONE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held = frozenset(json.loads(child.stdout.readline()))
        assert held == {max(cpu_cores.ALLOWED)}                                 # the highest core
        assert json.loads(registry.read_text()) == {str(child.pid): sorted(held)}
        rest = cpu_cores.ALLOWED - held
        assert cpu_cores.reserve(len(rest)) == frozenset()      # it would leave no core to the rest
        cpu_cores.keep_off()
        assert set(threads().values()) == {rest}
    finally:
        child.stdin.close()
        child.wait(30)
    cpu_cores.keep_off()                                    # its process ended: every core again
    assert set(threads().values()) == {cpu_cores.ALLOWED}
    mine = cpu_cores.reserve(1)
    assert mine == held and json.loads(registry.read_text()) == {str(os.getpid()): sorted(mine)}
    cpu_cores.release()
    assert json.loads(registry.read_text()) == {}


def test_a_garbled_registry_is_started_again(registry):
    registry.write_text('{"12')
    assert cpu_cores.reserve(1) == {max(cpu_cores.ALLOWED)}
    assert json.loads(registry.read_text()) == {str(os.getpid()): [max(cpu_cores.ALLOWED)]}
    cpu_cores.release()


def test_the_engine_process_pins_its_model_thread_and_this_process_keeps_off(registry, default_model_dir):
    settings = dict(dtype="float32", compile="off", num_pages=64, num_threads=1, timeout_s=120)
    with Runtime.local(str(default_model_dir), **settings) as local:            # the reference
        want = local.engine.generate([PROMPT], NEW, ignore_eos=True)[0]
    with Runtime.local(str(default_model_dir), engine_process=True, **settings) as rt:
        pid = rt._backend.restarting.engine.pid
        entries = json.loads(registry.read_text())
        assert list(entries) == [str(pid)]
        held = frozenset(entries[str(pid)])
        rest = cpu_cores.ALLOWED - held
        engine_threads = threads(pid)
        assert sum(cores == held for cores in engine_threads.values()) == 1      # the model thread
        assert set(engine_threads.values()) == {held, rest}                       # the others off it
        assert rt.launch(GREEDY, {"prompt": PROMPT, "n": NEW}).result(120)["tokens"] == want
        assert set(threads().values()) == {rest}             # the sandboxes' process kept off it
    assert json.loads(registry.read_text()) == {}            # the engine gave its cores back as it closed
    assert set(threads().values()) == {cpu_cores.ALLOWED}    # its engine ended: every core again


@pytest.mark.parametrize("setting", [dict(pin_cores=False, num_threads=1), dict(num_threads=0)],
                         ids=["pin_cores_off", "every_core"])
def test_nothing_is_pinned_when_switched_off_or_the_model_takes_every_core(registry, default_model_dir, setting):
    with Runtime.local(str(default_model_dir), engine_process=True, dtype="float32", compile="off",
                       num_pages=64, timeout_s=120, **setting) as rt:
        pid = rt._backend.restarting.engine.pid
        assert rt.launch(GREEDY, {"prompt": PROMPT, "n": 2}).result(120)["tokens"]
        assert set(threads(pid).values()) == {cpu_cores.ALLOWED}
        assert set(threads().values()) == {cpu_cores.ALLOWED}
    assert not registry.exists() or json.loads(registry.read_text()) == {}


def _cores(actor) -> tuple[int, set[frozenset[int]]]:
    """(an actor's process id, the sets of cores its threads may run on)."""
    return ray.get(actor.__ray_call__.remote(lambda self: (os.getpid(), {
        frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")})), timeout=60)


def test_on_a_cluster_the_engine_actor_pins_and_host_actors_keep_off():
    settings = {**DUMMY, "pin_cores": True}
    inputs = [{"prompt": [1 + i, 2, 3, 4], "n": 4} for i in range(2)]
    with Runtime.local(**settings) as local:
        want = [local.engine.generate([i["prompt"]], i["n"], ignore_eos=True)[0] for i in inputs]
    with two_nodes(), Runtime.connect(**settings) as runtime:
        processes = [runtime.launch(HOLDER, i) for i in inputs]
        try:
            ready(processes)
            engine_pid, engine_threads = _cores(ray.get_actor(f"{ENGINE_PREFIX}0:{DUMMY['model']}"))
            held = frozenset(json.loads(cpu_cores.REGISTRY.read_text()).get(str(engine_pid), []))
            hosts = {name: ray.get_actor(name) for name in ray.util.list_named_actors()
                     if name.startswith(INFERLET_PREFIX)}
            hosted = {name: {key[1] for key, _, _ in ray.get(actor.whereabouts.remote(), timeout=60)[1]}
                      for name, actor in hosts.items()}
            busy = [_cores(hosts[name])[1] for name, runs in hosted.items() if runs]
        finally:
            for p in processes:
                p.send("go")
        assert [p.result(120)["tokens"] for p in processes] == want
    rest = cpu_cores.ALLOWED - held
    assert len(held) == DUMMY["num_threads"] and engine_threads == {held, rest}
    assert set().union(*hosted.values()) == {p.name for p in processes}
    assert busy and all(cores == {rest} for cores in busy)           # each host actor running one
