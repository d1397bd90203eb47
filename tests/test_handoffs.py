"""The handoff counter (handoffs.py) by plain calls: every crossing counted, by kind."""

from __future__ import annotations

import logging
import threading

import pytest
import trio

from duplexrt.core.handoffs import OFFLOAD_KINDS, HandoffKind, Handoffs


async def test_an_offload_runs_on_a_worker_thread_and_counts_once():
    handoffs = Handoffs()
    main = threading.get_ident()
    ran_on = await handoffs.offload(HandoffKind.DECODE_OFFLOAD, threading.get_ident)
    stats = handoffs.statistics()
    assert ran_on != main
    assert stats[HandoffKind.DECODE_OFFLOAD] == 1 and stats.offloads == 1
    assert sum(stats.by_kind.values()) == 1


async def test_only_offload_kinds_may_offload():
    handoffs = Handoffs()
    with pytest.raises(ValueError, match="not an offload kind"):
        await handoffs.offload(HandoffKind.OUTPUT_DELIVERY, int)
    assert handoffs.statistics().offloads == 0


def test_offloads_are_the_offload_kinds_together():
    handoffs = Handoffs()
    for kind in HandoffKind:
        handoffs.count_from_any_thread(kind)
    stats = handoffs.statistics()
    assert stats.offloads == len(OFFLOAD_KINDS)
    assert set(stats.by_kind) == {kind.value for kind in HandoffKind}


async def test_counts_from_another_thread_are_kept():
    handoffs = Handoffs()

    def wake() -> None:
        for _ in range(1000):
            handoffs.count_from_any_thread(HandoffKind.SCHEDULER_WAKE)

    threads = [threading.Thread(target=wake) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert handoffs.statistics()[HandoffKind.SCHEDULER_WAKE] == 4000


async def test_a_delivery_runs_on_the_trio_thread_and_a_failing_one_is_logged_not_raised(caplog):
    handoffs = Handoffs()
    token = trio.lowlevel.current_trio_token()
    seen: list[int] = []
    done = trio.Event()

    def from_thread() -> None:
        assert handoffs.deliver_from_thread(token, HandoffKind.OUTPUT_DELIVERY,
                                             lambda: seen.append(threading.get_ident()))
        handoffs.deliver_from_thread(token, HandoffKind.LIFECYCLE, lambda: 1 / 0)
        token.run_sync_soon(done.set)

    with caplog.at_level(logging.ERROR, logger="duplexrt.handoffs"):
        await trio.to_thread.run_sync(from_thread)
        await done.wait()
    assert seen == [threading.get_ident()]  # ran on the trio thread
    stats = handoffs.statistics()
    assert stats[HandoffKind.OUTPUT_DELIVERY] == 1 and stats[HandoffKind.LIFECYCLE] == 1
    assert "delivery callback failed" in caplog.text


def test_a_delivery_after_trio_has_finished_says_so():
    handoffs = Handoffs()

    async def main() -> trio.lowlevel.TrioToken:
        return trio.lowlevel.current_trio_token()

    token = trio.run(main)
    assert handoffs.deliver_from_thread(token, HandoffKind.OUTPUT_DELIVERY, print) is False
