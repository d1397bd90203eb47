"""A headless Chromium driven over the DevTools protocol, for the browser tests.

Only what the tests need: open a page, evaluate JavaScript, take a screenshot.  The protocol
goes over trio-websocket (already a dependency), so a test's server and its browser share one
trio loop.  Chromium gets a fake microphone playing a WAV file; each page opened is granted it.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import shutil
import subprocess
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import trio
import trio_websocket

CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
                 if (path := shutil.which(name))), None)


class JavaScriptError(Exception):
    pass


class Page:
    def __init__(self, browser: Browser, session_id: str) -> None:
        self._browser = browser
        self.session_id = session_id

    async def send(self, method: str, **params: Any) -> dict:
        return await self._browser.send(method, session_id=self.session_id, **params)

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` (awaited if a promise), as JSON, run as a user gesture
        (what a click needs to start audio)."""
        reply = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                                awaitPromise=True, userGesture=True)
        if "exceptionDetails" in reply:
            raise JavaScriptError(reply["exceptionDetails"].get("exception", {}).get("description")
                                  or reply["exceptionDetails"].get("text"))
        return reply["result"].get("value")

    async def wait_for(self, expression: str, what: str, timeout: float = 15.0) -> Any:
        """Poll ``expression`` until it is truthy: a real browser runs in real time."""
        value = None
        with trio.move_on_after(timeout):
            while not (value := await self.evaluate(expression)):
                await trio.sleep(0.1)
            return value
        state = await self.evaluate("JSON.stringify(window.duplexrt || window.dashboard || null)")
        raise AssertionError(f"timed out waiting for {what}; page state: {state}")

    async def screenshot(self, path: Path) -> None:
        reply = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(reply["data"]))


class Browser:
    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self._ws = ws
        self._next_id = 0

    async def send(self, method: str, session_id: str | None = None, **params: Any) -> dict:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session_id:
            message["sessionId"] = session_id
        await self._ws.send_message(json.dumps(message))
        while True:  # events are not needed: skip them until the reply comes
            reply = json.loads(await self._ws.get_message())
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    async def set_microphone(self, origin: str, setting: str) -> None:
        """Grant or deny the microphone to ``origin``, as a person answering the prompt would."""
        await self.send("Browser.setPermission", permission={"name": "microphone"}, setting=setting, origin=origin)

    async def open(self, url: str, width: int = 1100, height: int = 800) -> Page:
        """A new tab at ``url``, its origin allowed the microphone."""
        parts = urlsplit(url)
        await self.set_microphone(f"{parts.scheme}://{parts.netloc}", "granted")
        target = await self.send("Target.createTarget", url="about:blank")
        attached = await self.send("Target.attachToTarget", targetId=target["targetId"], flatten=True)
        page = Page(self, attached["sessionId"])
        await page.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)
        await page.send("Page.enable")
        await page.send("Page.navigate", url=url)
        await page.wait_for("document.readyState === 'complete'", f"{url} to load")
        return page


@asynccontextmanager
async def open_browser(microphone_wav: Path) -> AsyncIterator[Browser]:
    """Headless Chromium with ``microphone_wav`` as its microphone (looped)."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="duplexrt-chromium-", ignore_cleanup_errors=True) as profile:
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                "--remote-debugging-port=0", f"--user-data-dir={profile}", "--autoplay-policy=no-user-gesture-required",
                "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={microphone_wav}", "about:blank"]
        log = Path(profile) / "chromium.log"
        with log.open("wb") as stderr:
            # Its own process group: the renderers and helpers go with it.
            process = await trio.lowlevel.open_process(args, stdout=subprocess.DEVNULL, stderr=stderr,
                                                       start_new_session=True)
        try:
            url = await _devtools_url(process, Path(profile), log)
            async with trio_websocket.open_websocket_url(url, max_message_size=64 * 1024 * 1024) as ws:
                browser = Browser(ws)
                yield browser
                with trio.move_on_after(5):
                    await ws.send_message(json.dumps({"id": 0, "method": "Browser.close"}))
                    await process.wait()
        finally:
            with trio.CancelScope(shield=True):
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()


async def _devtools_url(process: trio.Process, profile: Path, log: Path) -> str:
    """Chromium writes the port it chose, and the browser endpoint's path, into the profile."""
    active = profile / "DevToolsActivePort"
    with trio.move_on_after(30):
        while process.poll() is None:
            lines = active.read_text().split() if active.exists() else []
            if len(lines) >= 2:
                return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
            await trio.sleep(0.05)
    raise RuntimeError(f"Chromium did not open its DevTools port:\n{log.read_text(errors='replace')[-2000:]}")
