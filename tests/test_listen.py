"""A port another process holds is refused before the model loads (minutes for a 7B), naming the
address (``server/listen.py``)."""

from __future__ import annotations

import socket
import time

import pytest

from conftest import backend_info
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import load_config
from duplexrt.server import Server
from duplexrt.server.listen import check_free


class RecordingLoad(EchoBackend):
    """FAKE load(): records that the model would have been loaded."""

    loaded = False

    def load(self) -> None:
        RecordingLoad.loaded = True


@pytest.fixture
def taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


async def test_a_taken_port_is_refused_before_the_model_loads_naming_the_address(taken_port):
    config = load_config(None, [f"server.port={taken_port}", "metrics.log_stats=false"])
    RecordingLoad.loaded = False
    server = Server(config, RecordingLoad(backend_info(config, "echo"), {}))
    with pytest.raises(OSError) as refused:
        await server.run()
    assert not RecordingLoad.loaded, "the model was loaded before the port was checked"
    assert f"127.0.0.1:{taken_port}" in str(refused.value) and "another process listens there" in str(refused.value)


def test_a_free_port_and_port_zero_pass():
    check_free("127.0.0.1", 0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    check_free("127.0.0.1", free)


def test_serve_says_which_address_is_taken_without_loading_the_model(taken_port):
    from typer.testing import CliRunner

    from duplexrt_cli.app import app

    started = time.monotonic()
    result = CliRunner().invoke(app, ["serve", "--port", str(taken_port), "--config", "moshi-tiny", "--no-log-stats"])
    assert result.exit_code == 2
    assert "cannot listen" in result.output and f"127.0.0.1:{taken_port}" in result.output, result.output
    assert "moshi backend loaded" not in result.output and time.monotonic() - started < 15
