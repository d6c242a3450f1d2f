"""session.send_to between processes, locally and on a Ray cluster: order per sender, who sent what
(session.receive_from), a bounded mailbox (senders wait, then fail), and at once a clear error for a
process that is not running. On a cluster, three placements: every process in one inferlet host
actor (a message goes straight into the mailbox), each in an actor of its own (a Ray call to the
peer's actor), and launches alternating between two nodes. The dummy model: only the control plane
matters here."""
from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from cluster_helpers import two_nodes
from inferlet_helpers import on_a_cluster, pages_return, reachable
from pie_actors import InferletError, Runtime, Send

SETTINGS = dict(dtype="float32", num_pages=64, compile="off", timeout_s=120, mailbox_size=4, send_timeout_s=1.0)

RECEIVER = """
import asyncio
from inferlet import session

async def main(input):
    session.send("ready")
    got = []
    for _ in range(input["count"]):
        if input.get("slow"):
            await asyncio.sleep(0.05)
        got.append(await session.receive_from())
    plain = await session.receive()          # the documents' receive: the message alone
    return {"got": got, "plain": plain}
"""

SENDER = """
from inferlet import session

async def main(input):
    for i in range(input["count"]):
        session.send_to(input["to"], {"i": i})
    return {"sent": input["count"]}
"""

STUFFER = """
from inferlet import session, HostError

async def main(input):
    sent = 0
    try:
        for i in range(input["count"]):
            session.send_to(input["to"], i)
            sent += 1
    except HostError as e:
        return {"sent": sent, "error": str(e)}
    return {"sent": sent}
"""

DEAF = """
from inferlet import session

async def main(input):
    session.send("ready")
    await session.receive_file()              # never reads its mailbox until it gets a file
    return {"left": [await session.receive() for _ in range(input["count"])]}
"""

TWICE = """
from inferlet import session, HostError

async def main(input):
    session.send_to(input["to"], "first")
    await session.receive()                   # the test says when the peer has ended
    try:
        session.send_to(input["to"], "second")
    except HostError as e:
        return {"error": str(e)}
    return {"error": None}
"""

ONE = """
from inferlet import session

async def main(input):
    return {"got": await session.receive()}
"""


class _Alternating:
    """A runtime whose launches alternate between nodes: a message between two processes launched
    one after the other crosses nodes."""

    def __init__(self, runtime: Runtime, nodes: list[str]) -> None:
        self.runtime, self._nodes = runtime, itertools.cycle(nodes)

    def launch(self, *args: Any, **kwargs: Any) -> Any:
        return self.runtime.launch(*args, node=next(self._nodes), **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)


@pytest.fixture(scope="module", params=["local", "one_actor", "actor_each", "across_nodes"])
def placed(request, default_model_dir):
    """One runtime a placement, in turn (one Ray cluster at a time)."""
    if request.param == "local":
        with Runtime.local("dummy", **SETTINGS) as runtime:
            yield runtime
    elif request.param == "across_nodes":
        with two_nodes() as (_, nodes, _), Runtime.connect(model="dummy", **SETTINGS) as runtime:
            yield _Alternating(runtime, [nodes["a"], nodes["b"]])
    else:
        per_actor = 1 if request.param == "actor_each" else 64
        with on_a_cluster(model="dummy", inferlets_per_actor=per_actor, **SETTINGS) as runtime:
            yield runtime


@pytest.fixture
def runtime(placed):
    with pages_return(placed):
        yield placed


def test_each_senders_messages_arrive_in_order_with_its_name(runtime):
    inbox = runtime.launch(RECEIVER, {"count": 40}, name="inbox")
    assert next(inbox.events(timeout=300)) == Send("ready")
    senders = [runtime.launch(SENDER, {"to": "inbox", "count": 20}, name=name) for name in ("alpha", "beta")]
    assert [s.result(300) for s in senders] == [{"sent": 20}] * 2
    inbox.send("from the client")
    result = inbox.result(300)
    for name in ("alpha", "beta"):
        assert [m["i"] for sender, m in result["got"] if sender == name] == list(range(20))
    assert {sender for sender, _ in result["got"]} == {"alpha", "beta"}
    assert result["plain"] == "from the client"


def test_the_client_is_no_sender(runtime):
    inbox = runtime.launch(RECEIVER, {"count": 1})
    assert next(inbox.events(timeout=300)) == Send("ready")
    inbox.send({"hello": 1})
    inbox.send("bye")
    assert inbox.result(300) == {"got": [[None, {"hello": 1}]], "plain": "bye"}


def test_a_full_mailbox_makes_senders_wait_while_it_drains(runtime):
    """mailbox_size is 4: ten messages get through a slow reader, in order, none lost."""
    inbox = runtime.launch(RECEIVER, {"count": 10, "slow": True}, name="slow")
    assert next(inbox.events(timeout=300)) == Send("ready")
    assert runtime.launch(SENDER, {"to": "slow", "count": 10}, name="eager").result(300) == {"sent": 10}
    inbox.send("done")
    assert [m["i"] for _, m in inbox.result(300)["got"]] == list(range(10))


def test_a_mailbox_that_stays_full_fails_the_sender_after_its_timeout(runtime):
    deaf = runtime.launch(DEAF, {"count": 4}, name="deaf")
    assert next(deaf.events(timeout=300)) == Send("ready")
    result = runtime.launch(STUFFER, {"to": "deaf", "count": 10}).result(300)
    assert result["sent"] == 4 and "mailbox of 'deaf' stayed full for 1 s" in result["error"]
    deaf.send_file(b"now read")
    assert deaf.result(300) == {"left": [0, 1, 2, 3]}       # what was taken is kept, in order


def test_a_process_that_is_not_running_is_an_error_at_once(runtime):
    with pytest.raises(InferletError, match="no running inferlet named 'nobody'"):
        runtime.launch(SENDER, {"to": "nobody", "count": 1}).result(300)
    peer = runtime.launch(ONE, {}, name="peer")
    twice = runtime.launch(TWICE, {"to": "peer"})
    assert peer.result(300) == {"got": "first"}
    _wait_gone(runtime, "peer")
    twice.send("go")
    error = twice.result(300)["error"]
    assert "'peer'" in error and ("no running inferlet" in error or "has ended" in error)


def test_a_message_for_a_process_that_ended_says_how_it_ended(runtime):
    """The error names the process's end, a crash with its message: a sender told only that no
    such process runs cannot tell a typo from a peer that failed."""
    crasher = runtime.launch("async def main(input):\n    raise ValueError('boom')\n", {}, name="crasher")
    with pytest.raises(InferletError, match="boom"):
        crasher.result(300)
    finisher = runtime.launch(ONE, {}, name="finisher")
    finisher.send("bye")
    assert finisher.result(300) == {"got": "bye"}
    for name, how in (("crasher", "it failed, exception: ValueError: boom"), ("finisher", "it ended with a result")):
        _wait_gone(runtime, name)
        with pytest.raises(InferletError) as info:
            runtime.launch(SENDER, {"to": name, "count": 1}).result(300)
        assert f"no running inferlet named {name!r} ({how})" in info.value.message, info.value.message


def _wait_gone(runtime: Runtime, name: str) -> None:
    """Until a process of that name is no longer running (its end reached the runtime's books)."""
    end = time.monotonic() + 30
    while reachable(runtime, name):
        assert time.monotonic() < end
        time.sleep(0.1)
