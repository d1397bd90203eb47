"""What one wake-up of the load generator's shared pacing timer costs, in process, with a wake
that raises ``Cancelled`` out of its scope (``trio.sleep_forever``, as the pacer slept until
0.9) beside the quiet wake it has now (``duplexrt.client.pacer._sleep_out``).

Each round runs a ``Pacer`` with ``--waiters`` tasks that wait for times one tick apart, so that
every wake-up of the pacer releases one waiter; the figure is the thread's CPU time per wake-up,
best of ``--rounds``, both ways alternated in one process, so that the ratio is taken side by side.

Usage: python benchmarks/pacer_cost.py [--waiters 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import trio
import trio.testing

from duplexrt.client import pacer as pacer_module
from duplexrt.client.pacer import Pacer

QUIET = pacer_module._sleep_out


async def _raising(scope: trio.CancelScope) -> None:
    """The wake-up before: the scope's deadline cancels the sleep, and ``Cancelled`` unwinds."""
    await trio.sleep_forever()


async def _round(waiters: int) -> float:
    """Thread CPU seconds per wake-up of one pacer releasing ``waiters`` tasks one by one."""
    pacer = Pacer()
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        start = trio.current_time()
        for i in range(waiters):
            nursery.start_soon(pacer.wait_until, start + (i + 1) * 0.001)
        await trio.testing.wait_all_tasks_blocked()
        began = time.thread_time()
        wakes = pacer.statistics().wakes
        while pacer.statistics().released < waiters:
            await trio.sleep(0.01)
        spent = time.thread_time() - began
        wakes = pacer.statistics().wakes - wakes
        nursery.cancel_scope.cancel()
    return spent / wakes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    best = {"raising": float("inf"), "quiet": float("inf")}
    clock = trio.testing.MockClock(autojump_threshold=0)
    for _ in range(args.rounds):
        for name, sleep in (("raising", _raising), ("quiet", QUIET)):
            pacer_module._sleep_out = sleep
            try:
                per_wake = trio.run(_round, args.waiters, clock=clock)
            finally:
                pacer_module._sleep_out = QUIET
            best[name] = min(best[name], per_wake)
    print(f"{'pacer wake-up':<28} {'µs (thread CPU)':>16}")
    for name, seconds in best.items():
        print(f"{name:<28} {seconds * 1e6:>16.2f}")
    print(f"{'quiet / raising':<28} {best['quiet'] / best['raising']:>16.3f}")


if __name__ == "__main__":
    main()
