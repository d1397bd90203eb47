"""benchmarks/profile_server.py folds py-spy's collapsed stacks into layers.  These stacks are
written by hand in py-spy's format (a real py-spy run needs ptrace and takes a minute), from
frames a real run printed: they check that each of the runtime's files lands in its layer, that
the scheduler thread asleep counts as a wait and not as work, and that a path printed with the
checkout's prefix is read the same as one printed relative to it."""

from __future__ import annotations

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def profile_server():
    return load_benchmark("profile_server")


@pytest.mark.parametrize(("path", "layer"), [
    ("duplexrt/session/session.py", "session"),
    ("duplexrt/session/reader.py", "session"),
    ("duplexrt/session/writer.py", "session"),
    ("duplexrt/core/slot_owner.py", "session"),
    ("duplexrt/session/lifecycle.py", "session"),
    ("duplexrt/audio/framer.py", "session"),
    ("duplexrt/core/scheduler.py", "scheduler/inbox"),
    ("duplexrt/core/capacity.py", "scheduler/inbox"),
    ("duplexrt/core/affinity.py", "scheduler/inbox"),
    ("duplexrt/core/stage_meter.py", "metrics"),
    ("duplexrt/core/histogram.py", "metrics"),
    ("duplexrt/server/stats_log.py", "metrics"),
    ("duplexrt/server/metrics.py", "metrics"),
    ("duplexrt/server/app.py", "server glue"),
    ("duplexrt/wire/resume.py", "server glue"),
    ("duplexrt/wire/native.py", "WebSocket framing"),
    ("duplexrt/protocols/vad.py", "translator"),
    ("/work/checkout/duplexrt/session/writer.py", "session"),
    ("trio/_core/_run.py", "trio scheduling"),
    ("numpy/core/fromnumeric.py", None),
])
def test_each_file_is_in_its_layer(profile_server, path, layer):
    assert profile_server.layer_of(path) == layer


def _stack(thread: str, *frames: str, count: int = 1) -> str:
    return ";".join([f"thread (2103): {thread}", *frames]) + f" {count}"


SLEEP = ("Scheduler._serve (duplexrt/core/scheduler.py:446)", "Inbox.next_batch (duplexrt/core/inbox.py:283)")


@pytest.mark.parametrize("prefix", ["", "/work/checkout/"], ids=["relative", "absolute"])
def test_the_scheduler_asleep_is_a_wait_not_work(profile_server, prefix):
    profile = profile_server.Profile()
    profile.add(_stack("duplexrt-scheduler", *SLEEP, f"Inbox._sleep ({prefix}duplexrt/core/inbox.py:229)", count=5))
    profile.add(_stack("duplexrt-scheduler", *SLEEP[:1], "Scheduler._step (duplexrt/core/scheduler.py:530)", count=2))
    waits = profile.self_["scheduler thread"]
    assert waits[profile_server.WAIT] == 5
    assert waits["scheduler/inbox"] == 2
