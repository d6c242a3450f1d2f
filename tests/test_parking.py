"""Parked sessions: a process waiting in `session.receive()` with no pass in flight parks (at once
here: `park_after_s = 0`), and its working set is the first to leave a KV pool that runs short,
spilled to host memory or kept as its tokens. Three times more live sessions than the pool holds
each answer three turns, with the tokens of a run whose sessions never left the pool; the stats
count the spills and restores, and every page returns. `Pipeline.park()` parks at once; a parked
process is sent to, attached to (pie serve) and killed as a running one is; a set forked just
before it leaves the pool spills what its fork copies."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from pie_actors import Done, InferletError, Process, Runtime, Send
from pie_actors.client import Client
from pie_actors.config import ConfigError, load
from pie_actors.gpu.engine import Lane, PassRequest

from serve_helpers import KEY, idle, start
from tests.engine_helpers import make_engine

SETTINGS = dict(dtype="float32", timeout_s=300, compile="off", park_after_s=0)
SMALL = 10           # pages of 16 tokens: a session holds 5 after its third turn, so 2 fit at once
SESSIONS = 6
TOKENS = 8           # decoded a turn
TOPICS = ["the sea", "a mountain", "the moon", "a forest", "a city at night", "an old library"]

SESSION = """
from inferlet import model, session
from inferlet.eta import ForwardPass, Pipeline, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    feed = model.encode(input["prompt"])
    while (message := await session.receive()) is not None:
        feed += model.encode(message)
        reply = []
        for _ in range(input["tokens"]):
            fwd = ForwardPass()
            fwd.embed(feed)
            fwd.state([ws])
            token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
            pipe.submit(fwd)
            reply.append(await token)
            feed = [reply[-1]]
        session.send(reply)
        if input.get("park"):
            pipe.park()
    return {"folded": ws.folded()}
"""

HOG = """
from inferlet.eta import ForwardPass, Pipeline, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, fwd = WorkingSet(), ForwardPass()
    fwd.embed([100 + i for i in range(input["tokens"])])
    fwd.state([ws])
    token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    Pipeline().submit(fwd)
    return {"token": await token}
"""


def _prompt(i: int) -> str:
    return f"A short story about {TOPICS[i]}, told in three parts.\n"


def _message(i: int, turn: int) -> str:
    return f"\nPart {turn + 1} of the story about {TOPICS[i]}:"


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """Each session's replies with a pool that holds them all, never parked."""
    with Runtime.local(str(default_model_dir), **{**SETTINGS, "park_after_s": 3600}) as rt:
        replies = _converse(rt, SESSIONS, wait_parked=False)
        assert rt.stats()["parked"]["evicted_spilled"] == rt.stats()["parked"]["evicted_tokens"] == 0
        yield replies


@pytest.fixture(scope="module")
def spilling(default_model_dir):
    with Runtime.local(str(default_model_dir), num_pages=SMALL, **SETTINGS) as rt:
        yield rt


@pytest.fixture(scope="module")
def recomputing(default_model_dir):
    with Runtime.local(str(default_model_dir), num_pages=SMALL, spill_memory_mb=0, **SETTINGS) as rt:
        yield rt


def _parked(runtime: Runtime, sets: int) -> dict:
    """The parked stats once `sets` working sets are parked."""
    end = time.monotonic() + 30
    while (stats := runtime.stats()["parked"])["sets"] != sets:
        assert time.monotonic() < end, stats
        time.sleep(0.01)
    return stats


def _reply(process: Process) -> list[int]:
    for event in process.events():
        if isinstance(event, Send):
            return json.loads(event.text)
    raise AssertionError(f"the session ended: {process.result()}")


def _converse(runtime: Runtime, sessions: int, *, wait_parked: bool = True) -> list[list[list[int]]]:
    """Start `sessions` sessions, then have each answer three turns, one session at a time (each
    parked before the next is spoken to); returns the replies by session and turn."""
    processes = [runtime.launch(SESSION, {"prompt": _prompt(i), "tokens": TOKENS}) for i in range(sessions)]
    replies: list[list[list[int]]] = [[] for _ in range(sessions)]
    for turn in range(3):
        for i, process in enumerate(processes):
            process.send(_message(i, turn))
            replies[i].append(_reply(process))
            if wait_parked:           # its working set is made at its first turn
                _parked(runtime, i + 1 if turn == 0 else sessions)
    for process in processes:         # one at a time: each brings its set back to read it
        process.send(None)
        assert process.result()["folded"] > 4 * 16            # five pages, the last one partly
    return replies


def _settled(runtime: Runtime) -> dict:
    """The stats once no process runs; the page books balance and no page is referenced."""
    end = time.monotonic() + 30
    while (stats := runtime.stats())["connections"] or stats["processes"]:
        assert time.monotonic() < end, stats
        time.sleep(0.05)
    assert stats["kv"]["referenced"] == 0
    assert stats["parked"]["sets"] == stats["parked"]["spill_bytes"] == 0
    with runtime.engine._lock:
        runtime.engine.kv.check()
    return stats


def test_sessions_spilled_to_host_memory_answer_as_if_never_parked(spilling, reference):
    assert _converse(spilling, SESSIONS) == reference
    parked = _settled(spilling)["parked"]
    assert parked["evicted_spilled"] >= SESSIONS and parked["evicted_tokens"] == 0
    assert parked["restored_spilled"] >= SESSIONS and parked["restored_recomputed"] == 0


def test_sessions_kept_as_tokens_are_recomputed_with_the_same_tokens(recomputing, reference):
    assert _converse(recomputing, SESSIONS) == reference
    parked = _settled(recomputing)["parked"]
    assert parked["evicted_tokens"] >= SESSIONS and parked["evicted_spilled"] == 0
    assert parked["restored_recomputed"] >= SESSIONS and parked["restored_spilled"] == 0


def test_pipeline_park_parks_at_once(spilling, reference):
    """With parking after a receive put off for an hour, only `Pipeline.park()` parks the session,
    and a program that takes nearly the whole pool meanwhile evicts its set."""
    limits = dataclasses.replace(spilling.config.limits, park_after_s=3600)
    before = _settled(spilling)["parked"]
    session = spilling.launch(SESSION, {"prompt": _prompt(0), "tokens": TOKENS, "park": True}, limits=limits)
    session.send(_message(0, 0))
    assert _reply(session) == reference[0][0]
    assert _parked(spilling, 1)["kept"] == 1
    spilling.launch(HOG, {"tokens": (SMALL - 1) * 16}).result()
    assert spilling.stats()["parked"]["spilled"] == 1
    session.send(_message(0, 1))
    assert _reply(session) == reference[0][1]
    session.send(None)
    session.result()
    parked = _settled(spilling)["parked"]
    assert parked["evicted_spilled"] == before["evicted_spilled"] + 1
    assert parked["restored_spilled"] == before["restored_spilled"] + 1


def test_a_parked_process_is_sent_to_and_killed_as_a_running_one(recomputing, reference):
    limits = dataclasses.replace(recomputing.config.limits, park_after_s=0.2)    # parks a while after
    session = recomputing.launch(SESSION, {"prompt": _prompt(1), "tokens": TOKENS}, limits=limits)
    session.send(_message(1, 0))
    assert _reply(session) == reference[1][0]
    _parked(recomputing, 1)
    recomputing.launch(HOG, {"tokens": (SMALL - 1) * 16}).result()
    assert recomputing.stats()["parked"]["tokens"] == 1
    session.send(_message(1, 1))                     # sent to while parked, out of the pool
    assert _reply(session) == reference[1][1]
    _parked(recomputing, 1)
    recomputing.launch(HOG, {"tokens": (SMALL - 1) * 16}).result()
    assert recomputing.stats()["parked"]["tokens"] == 1
    session.kill()                                   # killed while parked, out of the pool
    with pytest.raises(InferletError) as failed:
        session.result()
    assert failed.value.kind == "cancelled"
    _settled(recomputing)


def test_a_parked_process_on_pie_serve_is_attached_to_again(default_model_dir, reference):
    """A client detaches from a session; parked meanwhile, its set is spilled; another connection
    attaches to it and the next turn answers as before."""
    with start(default_model_dir, api_keys=(KEY,), num_pages=SMALL, park_after_s=0) as server:
        client = Client(server.url, KEY)
        session = client.submit(SESSION, {"prompt": _prompt(2), "tokens": TOKENS})
        session.send(_message(2, 0))
        assert _reply(session) == reference[2][0]
        _parked(server.runtime, 1)
        session.detach()
        client.close()
        server.runtime.launch(HOG, {"tokens": (SMALL - 1) * 16}).result()
        assert server.runtime.stats()["parked"]["spilled"] == 1
        with Client(server.url, KEY) as client:
            session = client.attach(session.id)
            session.send(_message(2, 1))
            assert _reply(session) == reference[2][1]
            session.send(None)
            assert isinstance(list(session.events())[-1], Done)
        stats = idle(server)
        assert stats["kv"]["referenced"] == stats["parked"]["sets"] == 0
        assert stats["parked"]["restored_spilled"] == 1


def test_a_set_forked_just_before_it_is_evicted_spills_what_its_fork_copies(default_model_dir):
    """A parked set whose tail page's copy from its parent has not run yet when the pool runs short
    spills the parent's rows for that page, and continues as its parent does."""
    engine = make_engine(default_model_dir, num_pages=6)
    greedy = lambda logits: int(logits[-1].argmax())                 # noqa: E731

    def decode(seq: int, feed: list[int], n: int) -> list[int]:
        out = []
        for _ in range(n):
            future = engine.submit(PassRequest([Lane(seq, feed)], epilogue=greedy))
            engine.run_until_idle()
            out.append(future.result())
            feed = [out[-1]]
        return out

    parent = engine.create_sequence()
    first = decode(parent, engine.tokenizer.encode(_prompt(0) + _message(0, 0)), 1)   # 2 pages, 1 full
    child = engine.fork(parent)                  # its tail page is copied before the next batch
    engine.park([child])
    hog = engine.create_sequence()               # takes all but 2 pages: the child has to go
    engine.submit(PassRequest([Lane(hog, [100 + i for i in range(4 * 16)])], epilogue=greedy))
    engine.run_until_idle()
    assert engine.parked_stats()["spilled"] == 1
    engine.free(hog)
    assert engine.unpark([child], None) is None
    assert decode(child, first, 6) == decode(parent, first, 6)
    engine.free(child)
    engine.free(parent)
    assert engine.kv_stats()["referenced"] == 0
    engine.kv.check()


def test_a_negative_park_after_s_is_refused():
    with pytest.raises(ConfigError, match="park_after_s"):
        load(park_after_s=-1)
