"""LoopDelivery: engine-thread updates reach an asyncio loop in order, a burst in one wake-up."""
from __future__ import annotations

import asyncio
import threading
import time

from constrained_spec.engine.delivery import LoopDelivery


class CountingDelivery(LoopDelivery):
    flushes = 0

    def _flush(self):
        CountingDelivery.flushes += 1
        super()._flush()


def test_burst_arrives_in_order_with_one_wake_up():
    async def main():
        loop = asyncio.get_running_loop()
        d = CountingDelivery(loop)
        got: list[int] = []
        done = asyncio.Event()

        def producer():
            for i in range(200):  # one engine step's updates, while the loop is busy
                d.put(got.append, i)
            d.put(lambda _: done.set(), None)
        t = threading.Thread(target=producer)
        t.start()
        t.join()  # the loop has not run yet: everything is queued behind one scheduled flush
        await asyncio.wait_for(done.wait(), 5)
        assert got == list(range(200))
        assert CountingDelivery.flushes == 1
        # later puts schedule a new flush
        d.put(got.append, 200)
        await asyncio.sleep(0.01)
        assert got[-1] == 200 and CountingDelivery.flushes == 2
    asyncio.run(main())


def test_for_loop_shares_one_delivery_and_survives_a_closed_loop():
    loop = asyncio.new_event_loop()
    d = LoopDelivery.for_loop(loop)
    assert LoopDelivery.for_loop(loop) is d
    loop.close()
    d.put(print, "never delivered")  # no exception: the loop is gone
    d.put(print, "still none")
    other = asyncio.new_event_loop()
    try:
        assert LoopDelivery.for_loop(other) is not d
    finally:
        other.close()


def test_interleaved_producers_keep_each_ones_order():
    async def main():
        d = LoopDelivery(asyncio.get_running_loop())
        got: list[tuple[int, int]] = []

        def producer(k):
            for i in range(300):
                d.put(got.append, (k, i))
                if i % 50 == 0:
                    time.sleep(0.001)
        threads = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while (any(t.is_alive() for t in threads) or len(got) < 900) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert len(got) == 900
        for k in range(3):
            assert [i for kk, i in got if kk == k] == list(range(300))
    asyncio.run(main())
