"""What the two browser drivers share (tests/cdp.py for Chromium, tests/bidi.py for Firefox).

Both protocols are JSON commands over one WebSocket, ``{"id", "method", "params"}``, each answered
by the message carrying its id, with events in between; both browsers run headless from a fresh
profile and say in a file there which port they listen on.  The WebSocket is trio-websocket
(already a dependency), so a test's server and its browser share one trio loop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
import trio_websocket


class JavaScriptError(Exception):
    pass


class Connection:
    """One WebSocket to a browser's remote protocol, one command at a time."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self._ws = ws
        self._next_id = 0

    async def command(self, method: str, params: dict[str, Any], **envelope: Any) -> dict:
        """The result of ``method``; ``envelope`` adds fields beside ``params`` (CDP's sessionId)."""
        self._next_id += 1
        await self._ws.send_message(json.dumps({"id": self._next_id, "method": method, "params": params,
                                                **envelope}))
        while True:  # events are not needed: skip them until the reply comes
            reply = json.loads(await self._ws.get_message())
            if reply.get("id") == self._next_id:
                if "error" in reply:  # CDP: an object; BiDi: a code, and a message beside it
                    raise RuntimeError(f"{method}: {reply['error']} {reply.get('message', '')}".rstrip())
                return reply["result"]


class Page:
    """A tab; each driver says how to evaluate JavaScript in it."""

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` (awaited if a promise), as JSON, run as a user gesture
        (what a click needs to start audio)."""
        raise NotImplementedError

    async def wait_for(self, expression: str, what: str, timeout: float = 15.0) -> Any:
        """Poll ``expression`` until it is truthy: a real browser runs in real time."""
        value = None
        with trio.move_on_after(timeout):
            while not (value := await self.evaluate(expression)):
                await trio.sleep(0.1)
            return value
        state = await self.evaluate("JSON.stringify(window.duplexrt || window.dashboard || null)")
        raise AssertionError(f"timed out waiting for {what}; page state: {state}")


@asynccontextmanager
async def launch(name: str, args: Callable[[Path], list[str]], endpoint: Callable[[Path], str | None],
                 quit_command: dict[str, Any], env: dict[str, str] | None = None,
                 ) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """Browser ``name`` started with ``args(profile)`` in a fresh profile, ``env`` added to its
    environment, and a WebSocket to it.

    ``endpoint(profile)`` is its WebSocket URL once the browser has written it, else None.  At
    the end ``quit_command`` asks it to close; whatever is left of it is killed.
    """
    with tempfile.TemporaryDirectory(prefix=f"duplexrt-{name}-", ignore_cleanup_errors=True) as directory:
        profile = Path(directory)
        log = profile / f"{name}.log"
        with log.open("wb") as stderr:
            # Its own process group: the content processes and helpers go with it.
            process = await trio.lowlevel.open_process(args(profile), env=os.environ | (env or {}),
                                                       stdout=subprocess.DEVNULL, stderr=stderr,
                                                       start_new_session=True)
        try:
            url = None
            with trio.move_on_after(30):
                while process.poll() is None and not (url := endpoint(profile)):
                    await trio.sleep(0.05)
            if not url:
                raise RuntimeError(f"{name} did not open its remote port:\n{log.read_text(errors='replace')[-2000:]}")
            async with trio_websocket.open_websocket_url(url, max_message_size=64 * 1024 * 1024) as ws:
                yield ws
                with trio.move_on_after(5):
                    await ws.send_message(json.dumps(quit_command))
                    await process.wait()
        finally:
            with trio.CancelScope(shield=True):
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
