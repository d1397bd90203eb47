"""A headless Chromium driven over the DevTools protocol, for the browser tests.

Only what the tests need: open a page, evaluate JavaScript, take a screenshot (what the two
drivers share is in tests/browsers.py).  Chromium gets a fake microphone playing a WAV file;
each page opened is granted it.
"""

from __future__ import annotations

import base64
import shutil
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

from browsers import Connection, JavaScriptError, Page, launch

CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
                 if (path := shutil.which(name))), None)


class ChromiumPage(Page):
    def __init__(self, browser: Browser, session_id: str) -> None:
        self._browser = browser
        self.session_id = session_id

    async def send(self, method: str, **params: Any) -> dict:
        return await self._browser.command(method, params, sessionId=self.session_id)

    async def evaluate(self, expression: str) -> Any:
        reply = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                                awaitPromise=True, userGesture=True)
        if "exceptionDetails" in reply:
            raise JavaScriptError(reply["exceptionDetails"].get("exception", {}).get("description")
                                  or reply["exceptionDetails"].get("text"))
        return reply["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        reply = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(reply["data"]))


class Browser(Connection):
    async def send(self, method: str, **params: Any) -> dict:
        return await self.command(method, params)

    async def set_microphone(self, origin: str, setting: str) -> None:
        """Grant or deny the microphone to ``origin``, as a person answering the prompt would."""
        await self.send("Browser.setPermission", permission={"name": "microphone"}, setting=setting, origin=origin)

    async def open(self, url: str, width: int = 1100, height: int = 800) -> ChromiumPage:
        """A new tab at ``url``, its origin allowed the microphone."""
        parts = urlsplit(url)
        await self.set_microphone(f"{parts.scheme}://{parts.netloc}", "granted")
        target = await self.send("Target.createTarget", url="about:blank")
        attached = await self.send("Target.attachToTarget", targetId=target["targetId"], flatten=True)
        page = ChromiumPage(self, attached["sessionId"])
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

    def args(profile: Path) -> list[str]:
        return [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                "--remote-debugging-port=0", f"--user-data-dir={profile}", "--autoplay-policy=no-user-gesture-required",
                "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={microphone_wav}", "about:blank"]

    async with launch("chromium", args, _devtools_url, {"id": 0, "method": "Browser.close"}) as ws:
        yield Browser(ws)


def _devtools_url(profile: Path) -> str | None:
    """Chromium writes the port it chose, and the browser endpoint's path, into the profile."""
    active = profile / "DevToolsActivePort"
    lines = active.read_text().split() if active.exists() else []
    return f"ws://127.0.0.1:{lines[0]}{lines[1]}" if len(lines) >= 2 else None
