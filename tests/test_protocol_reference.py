"""``docs/protocols.md`` is the wire reference an integrator writes a client from: its tables of
events and error codes must be exactly what the translators speak, so it cannot drift.

The names are read from the source, not from running sessions: every event type a translator
writes or dispatches on, every code given to a ``ProtocolError`` (directly, or through a helper
that passes its first argument on), every Moshi message kind.  A route added to
``duplexrt/routes.py`` needs a section in the document; its tables are compared once its protocol
is listed in ``SOURCES`` below."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from duplexrt.protocols import moshi
from duplexrt.routes import ROUTE_TABLE

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "protocols.md"
PROTOCOLS = ROOT / "duplexrt" / "protocols"

#: Protocol -> its translator's modules (``base.py``: the default ``session.resumed``).
SOURCES: dict[str, tuple[str, ...]] = {
    "duplex": ("raw.py", "base.py"),
    "realtime": ("realtime.py", "realtime_client_events.py", "realtime_server_events.py", "realtime_items.py",
                 "realtime_session.py", "realtime_transcripts.py", "b64audio.py"),
    "live": ("live.py", "base.py", "b64audio.py"),
    "moshi": ("moshi.py",),
    "twilio": ("twilio.py",),
}
#: Where the errors every route shares are raised: bad JSON, the audio itself, a resume that
#: fails after the upgrade (sent as the route's error; one refused before it is an HTTP status).
SHARED_ERROR_SOURCES = ("duplexrt/protocols/events.py", "duplexrt/session/reader.py", "duplexrt/wire/resume.py")

_DOTTED = r"[a-z_]+(?:\.[a-z_]+)+"


def _code(path: Path) -> str:
    """The module without its docstrings and comments (``ast.unparse``: single quotes)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def _source_events(protocol: str) -> tuple[set[str], set[str]]:
    """(client event types, server event types) a translator reads and writes."""
    text = "\n".join(_code(PROTOCOLS / name) for name in SOURCES[protocol])
    server = set(re.findall(r"\.event\('([\w.]+)'", text))
    server |= set(re.findall(rf"\{{'type': '({_DOTTED}|error)'", text))
    server |= set(re.findall(rf"self\.\w+ = '({_DOTTED})'", text))  # the GA/beta names
    server |= set(re.findall(rf'"type":"({_DOTTED})"', text))  # JSON written by hand
    client = set(re.findall(rf"'({_DOTTED})': self\._\w+", text))  # dispatch tables
    for name in ("UNSUPPORTED", "_UNSUPPORTED", "_APPENDS"):  # events refused or acknowledged by name
        match = re.search(rf"^{name}(?::[^=]+)? = ([({{].*)$", text, re.M)
        if match:
            client |= set(re.findall(rf"'({_DOTTED})'", match.group(1)))
    if protocol == "duplex":  # no nested objects: every type is an event
        server |= set(re.findall(r"\{'type': '([\w.]+)'", text))
        client |= set(re.findall(r"kind == '([\w.]+)'", text))
    if protocol == "twilio":  # Twilio's events are named by "event", not "type"
        client = set(re.findall(r"kind == '(\w+)'", text))
        for group in re.findall(r"kind in \(([^)]*)\)", text):
            client |= set(re.findall(r"'(\w+)'", group))
        server = set(re.findall(r'\{"event":"(\w+)"', text))
    if protocol == "live":  # session.<kind>.append is acknowledged as session.<kind>.appended
        server |= {name + "ed" for name in client if name.endswith(".append") and name != "session.input_audio.append"}
    return client, server


def _error_codes(paths: list[Path]) -> set[str]:
    """Codes given to ProtocolError/ResumeError, directly or through a helper whose first
    parameter becomes the code."""
    codes: set[str] = set()
    for path in paths:
        tree = ast.parse(path.read_text())
        helpers = {"ProtocolError": 0, "ResumeError": 1}  # the code's position
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.args.args:
                params = [arg.arg for arg in node.args.args if arg.arg != "self"]
                for call in ast.walk(node):
                    if (isinstance(call, ast.Call) and _name(call.func) == "ProtocolError" and call.args
                            and isinstance(call.args[0], ast.Name) and call.args[0].id in params[:1]):
                        helpers[node.name] = 0
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and _name(call.func) in helpers:
                position = helpers[_name(call.func)]
                if len(call.args) > position and isinstance(call.args[position], ast.Constant) \
                        and isinstance(call.args[position].value, str):
                    codes.add(call.args[position].value)
    return codes


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


# -- the document ----------------------------------------------------------------------------------


def _sections() -> dict[str, str]:
    """``## `/path` ...`` sections of the document, by each path named in their heading."""
    sections: dict[str, str] = {}
    for part in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        for path in re.findall(r"`(/[^`?]*)", heading):
            sections[path] = body
    return sections


def _table_column(text: str, header: str) -> set[str]:
    """The backticked names in the first cell of every row of the tables whose first header
    cell is ``header``."""
    names: set[str] = set()
    rows = text.splitlines()
    for i, line in enumerate(rows):
        if not line.startswith(f"| {header} |"):
            continue
        for row in rows[i + 2:]:
            if not row.startswith("|"):
                break
            names |= set(re.findall(r"`([^`]+)`", row.split("|")[1]))
    return names


def _documented_routes() -> dict[str, str]:
    return {route.path: route.protocol for route in ROUTE_TABLE}


def test_every_route_has_a_section():
    sections = _sections()
    missing = [path for path in _documented_routes() if path not in sections]
    assert not missing, f"docs/protocols.md has no section for {missing}"


@pytest.mark.parametrize("path", [route.path for route in ROUTE_TABLE
                                  if route.protocol in SOURCES and route.protocol != "moshi" and not route.variant])
def test_the_documented_events_are_the_ones_the_translator_reads_and_writes(path):
    protocol = _documented_routes()[path]
    client, server = _source_events(protocol)
    section = _sections()[path]
    assert _table_column(section, "Client event") == client
    assert _table_column(section, "Server event") == server


def test_the_documented_moshi_kinds_are_the_translators():
    section = _sections()["/api/chat"]
    rows = [row.split("|") for row in section.splitlines() if re.match(r"\| \d+ \|", row)]
    documented = {int(cells[1]): cells[2].strip().strip("`") for cells in rows}
    kinds = {name.lower(): getattr(moshi, name) for name in ("HANDSHAKE", "AUDIO", "TEXT", "CONTROL", "METADATA",
                                                             "ERROR", "PING")}
    assert documented == {value: name for name, value in kinds.items()}
    controls = _table_column(section, "Control")
    assert controls == {f"{name} ({value})" for name, value in moshi.CONTROL_CODES.items()}


def test_the_documented_error_codes_are_the_ones_sent():
    paths = [PROTOCOLS / name for protocol in SOURCES for name in SOURCES[protocol]]
    paths += [ROOT / name for name in SHARED_ERROR_SOURCES]
    sent = _error_codes(paths)
    documented = _table_column(DOC.read_text(), "Error code")
    assert documented == sent, (f"undocumented: {sorted(sent - documented)}; "
                                f"documented, never sent: {sorted(documented - sent)}")


def test_the_source_reading_finds_what_it_should():
    """The readers above are regular expressions over the source: a change of style in a
    translator must not make them find nothing and the comparison pass on empty sets."""
    client, server = _source_events("realtime")
    assert {"input_audio_buffer.append", "session.update"} <= client
    assert {"response.output_audio.delta", "response.audio.delta", "error"} <= server
    assert _source_events("twilio") == ({"connected", "start", "media", "mark", "dtmf", "stop"}, {"media", "mark"})
    client, server = _source_events("duplex")
    assert client == {"input.end", "ping"} and {"session.created", "text", "pong", "session.end"} <= server
    assert {"invalid_json", "persona_locked", "resume_in_progress", "audio_too_long"} <= _error_codes(
        [PROTOCOLS / "events.py", PROTOCOLS / "realtime.py", ROOT / "duplexrt/wire/resume.py",
         ROOT / "duplexrt/session/reader.py", PROTOCOLS / "b64audio.py"])
