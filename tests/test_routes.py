"""The route table (duplexrt/routes.py) is the only place routes are written: the server, the
client, ``simulate`` and the CLI's help all follow it."""

from __future__ import annotations

from typer.testing import CliRunner

from duplexrt.client.protocols import ROUTES as CLIENT, route_of
from duplexrt.routes import ROUTE_TABLE
from duplexrt.server.routes import ROUTES as SERVER
from duplexrt.simulate.runner import default_format
from duplexrt_cli.app import app


def test_the_server_serves_every_route_of_the_table_with_its_protocol():
    assert {path: route.name for path, route in SERVER.items()} == {r.path: r.protocol for r in ROUTE_TABLE}


def test_a_client_speaks_every_plain_route_and_simulate_knows_its_format():
    plain = [r for r in ROUTE_TABLE if not r.variant]
    assert CLIENT == {r.path: r.protocol for r in plain}
    for route in plain:
        url = f"ws://127.0.0.1:1/prefix{route.path}"
        assert route_of(url) == route.protocol
        assert default_format(url) == route.simulate_format


def test_serve_help_lists_every_route():
    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for route in ROUTE_TABLE:
        assert route.path in result.output
