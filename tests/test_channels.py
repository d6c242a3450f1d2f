"""ChannelStore: typed queues in engine memory, their limits, subscription and poisoning."""
from __future__ import annotations

import threading

import pytest
import torch

from pie_actors.gpu.engine.channels import ChannelError, ChannelStore


def test_values_queue_in_order_within_capacity_and_shape():
    store = ChannelStore()
    cid = store.create([2], "i32", capacity=2, values=[1, 2])
    store.put(cid, torch.tensor([3, 4]))
    with pytest.raises(ChannelError, match="is full"):
        store.put(cid, [5, 6])
    assert store.take(cid).tolist() == [1, 2] and store.take(cid).dtype == torch.int32
    with pytest.raises(ChannelError, match="is empty"):
        store.take(cid)
    with pytest.raises(ChannelError, match="does not fit"):
        store.put(cid, [1, 2, 3])
    for shape, dtype, capacity, message in [([-1], "i32", 1, "non-negative"), ([1], "q8", 1, "unknown channel dtype"),
                                            ([1], "i32", 0, "capacity")]:
        with pytest.raises(ChannelError, match=message):
            store.create(shape, dtype, capacity)


def test_the_memory_budget_is_reserved_at_creation_and_returned_on_free():
    store = ChannelStore(memory_budget=1000)
    a = store.create([100], "f32", capacity=2)          # 800 bytes
    with pytest.raises(ChannelError, match="needs 400 bytes"):
        store.create([100], "i32")
    store.free(a)
    assert store.reserved == 0
    store.create([250], "f32")


def test_packed_bits_unpack_to_bools():
    store = ChannelStore()
    cid = store.create([40], "bool")
    store.put_bits(cid, [-2**31 | 5, 1 << 7], 40)       # bits 0, 2, 31 of word 0; bit 7 of word 1
    assert torch.nonzero(store.take(cid)).flatten().tolist() == [0, 2, 31, 39]


def test_subscribers_get_values_and_poison():
    store = ChannelStore()
    cid = store.create([1], "i64", capacity=4, values=[7])
    got = []
    store.subscribe(cid, lambda c, value, error: got.append((value, error)))
    store.put(cid, [8])
    store.poison([cid], "PassError: bad")
    assert got == [([7], None), ([8], None), (None, "PassError: bad")]
    with pytest.raises(ChannelError, match="poisoned by a failed pass: PassError: bad"):
        store.put(cid, [9])


def test_a_put_during_a_subscription_comes_after_the_values_queued_before_it():
    """The engine thread may put while the data plane subscribes: the subscriber must get the
    queued values first. Here the put starts while the first queued value is being handed over."""
    store = ChannelStore()
    cid = store.create([1], "i64", capacity=4, values=[1])
    store.put(cid, [2])
    got, putter = [], []

    def sink(c, value, error):
        got.append(value[0])
        if not putter:
            putter.append(threading.Thread(target=store.put, args=(cid, [3])))
            putter[0].start()
            putter[0].join(0.5)            # the put waits for the subscription to finish
    store.subscribe(cid, sink)
    putter[0].join()
    assert got == [1, 2, 3]


def test_snapshot_and_restore_device_channels():
    store = ChannelStore()
    cid = store.create([1], "i32", capacity=2, values=[1])
    snap = store.snapshot([cid])
    store.take(cid)
    store.put(cid, [2])
    store.restore(snap)
    assert store.take(cid).tolist() == [1]
