"""A headless Firefox driven over WebDriver BiDi, for the browser tests.

Only what the tests need: open a page and evaluate JavaScript in it (what this shares with the
Chromium driver is in tests/browsers.py).  Firefox's fake microphone is a tone it makes itself,
granted to every page without a prompt; both come from prefs in the profile's user.js.  Its
speaker is the null sink of a private PulseAudio daemon (tests/pulse.py): unlike headless
Chromium, headless Firefox has no audio output of its own.
"""

from __future__ import annotations

import json
import math
import shutil
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from browsers import Connection, JavaScriptError, Page, launch
from pulse import audio_server

FIREFOX = next((path for name in ("firefox-esr", "firefox") if (path := shutil.which(name))), None)

PREFS = {
    # The microphone: a fake device playing a tone, and no permission prompt for it.
    "media.navigator.streams.fake": True,
    "media.navigator.permission.disabled": True,
    # A fresh profile would otherwise open first-run and update pages, and phone home.
    "browser.shell.checkDefaultBrowser": False,
    "browser.startup.homepage_override.mstone": "ignore",
    "datareporting.policy.dataSubmissionEnabled": False,
    "app.update.disabledForTesting": True,
}


class FirefoxPage(Page):
    def __init__(self, browser: Browser, context: str) -> None:
        self._browser = browser
        self.context = context

    async def evaluate(self, expression: str) -> Any:
        # A script, its last statement's value the result; unlike CDP's, no top-level await.
        # userActivation: the click that starts the page counts as the person's, under Firefox's
        # default autoplay policy (nothing here relaxes it).
        reply = await self._browser.command("script.evaluate", {
            "expression": expression, "target": {"context": self.context}, "awaitPromise": True,
            "userActivation": True, "resultOwnership": "none",
            "serializationOptions": {"maxObjectDepth": None}})
        if reply["type"] == "exception":
            raise JavaScriptError(reply["exceptionDetails"]["text"])
        return _value(reply["result"])


class Browser(Connection):
    async def open(self, url: str) -> FirefoxPage:
        """A new tab at ``url``, loaded."""
        created = await self.command("browsingContext.create", {"type": "tab"})
        await self.command("browsingContext.navigate", {"context": created["context"], "url": url, "wait": "complete"})
        return FirefoxPage(self, created["context"])


@asynccontextmanager
async def open_browser(audio_output: bool = True, **prefs: Any) -> AsyncIterator[Browser]:
    """Headless Firefox with its fake microphone, a BiDi session open; ``prefs`` (dots spelt as
    double underscores) change or add to PREFS.

    Its audio goes to a private PulseAudio null sink for as long as it runs (needs
    tests/pulse.py's PULSEAUDIO, which says why no pref of Firefox's can do instead).  With
    ``audio_output`` False it has no audio output at all.
    """
    assert FIREFOX is not None
    chosen = PREFS | {name.replace("__", "."): value for name, value in prefs.items()}

    def args(profile: Path) -> list[str]:
        (profile / "user.js").write_text("".join(f"user_pref({json.dumps(k)}, {json.dumps(v)});\n"
                                                 for k, v in chosen.items()))
        return [FIREFOX, "-headless", "-no-remote", "-profile", str(profile), "--remote-debugging-port=0",
                "about:blank"]

    quit_command = {"id": 0, "method": "browser.close", "params": {}}
    async with audio_server(running=audio_output) as env, launch("firefox", args, _bidi_url, quit_command, env) as ws:
        browser = Browser(ws)
        await browser.command("session.new", {"capabilities": {}})
        yield browser


def _bidi_url(profile: Path) -> str | None:
    """Firefox writes the host and port it chose into the profile."""
    try:
        server = json.loads((profile / "WebDriverBiDiServer.json").read_text())
    except (OSError, ValueError):  # not there yet, or half written
        return None
    return f"ws://{server['ws_host']}:{server['ws_port']}/session"


def _value(remote: dict) -> Any:
    """A BiDi remote value as plain JSON (what CDP's returnByValue gives)."""
    kind, value = remote["type"], remote.get("value")
    if kind == "number" and isinstance(value, str):  # NaN, -0, Infinity, -Infinity
        return {"NaN": math.nan, "-0": -0.0, "Infinity": math.inf, "-Infinity": -math.inf}[value]
    if kind in ("array", "set"):
        return [_value(item) for item in value]
    if kind in ("object", "map"):
        return {key if isinstance(key, str) else _value(key): _value(item) for key, item in value}
    if kind in ("string", "number", "boolean", "null", "undefined"):
        return value
    return {"type": kind}  # a node, window, function...: the tests never read these
