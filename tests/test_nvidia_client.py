"""NVIDIA's own PersonaPlex web client, unmodified, against ``duplexrt serve --config personaplex-tiny``.

The client (``client/`` of github.com/NVIDIA/personaplex, MIT, a React/Vite app) is on no package
index and is not vendored here: build it yourself and name its ``dist/`` folder, else this test is
skipped::

    git clone https://github.com/NVIDIA/personaplex && cd personaplex/client
    npm install && npx vite build          # (``npm run build`` = tsc && vite build, also passes)
    DUPLEXRT_NVIDIA_CLIENT_DIST=$PWD/dist pytest tests/test_nvidia_client.py

Its ``dist/`` is served as is from a loopback port; ``?worker_addr=HOST:PORT`` (``Queue.tsx``)
points it at the server, on another loopback port (a loopback page may open a session on a
keyless server: ``duplexrt/server/origin.py``).  Its queue API (``VITE_QUEUE_API_URL``) is never
called by the conversation page.  In headless Chromium with a fake microphone (tests/cdp.py) the
test types a role prompt and picks a voice in the client's own form, presses Connect, and checks:
the WebSocket went to ``/api/chat`` with that ``text_prompt`` and ``voice_prompt``; the server held
the handshake until the prompt had run, then sent its metadata and audio; the page called itself
connected, sent the microphone, played the model's audio and showed the text it got; the server's
``/stats`` counts a new persona prefilled (a prompt-cache miss); the server's log says the session
opened and, once Disconnect is pressed, ended.  The server also writes down the caller's words
(``stt-tiny``): the client, which does not ask for them (``/api/chat?input_text=1``), gets none,
only the message kinds its decoder knows, and no uncaught error.  The page is only watched (a wrapper around
``WebSocket`` added before its scripts run), never changed.  With DUPLEXRT_SCREENSHOTS=DIR the
screenshot of the conversation is kept there as ``nvidia-client.png``.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import wave
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import numpy as np
import pytest
import trio
import trio_websocket

from cdp import CHROMIUM, Browser, ChromiumPage, open_browser

DIST = os.environ.get("DUPLEXRT_NVIDIA_CLIENT_DIST")

pytestmark = [
    pytest.mark.skipif(not DIST, reason="DUPLEXRT_NVIDIA_CLIENT_DIST is not set: build NVIDIA/personaplex's client/ "
                       "(npm install && npx vite build) and name its dist/ folder; it is on no package index"),
    pytest.mark.skipif(bool(DIST) and not (Path(DIST or ".") / "index.html").is_file(),
                       reason=f"DUPLEXRT_NVIDIA_CLIENT_DIST={DIST} has no index.html: not a built client"),
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (CI installs Debian's)"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("moshi") is None,
                       reason="the personaplex-tiny preset needs torch and moshi"),
]

PROMPT = "You are Lou, a patient pirate who sells second-hand boats (50% off & free rum?)."
VOICE = "NATM1.pt"  # the client's own option values are file names

# Runs in the page before its own scripts: records what goes over each WebSocket, by message kind
# (Moshi protocol: 0 handshake, 1 audio, 2 text, 4 metadata, 5 error), and console errors.
WATCH = r"""
(() => {
  const seen = window.__nv = {sockets: [], received: {}, sent: {}, order: [], audioBytes: 0, text: [],
                              metadata: [], errors: []};
  const kindOf = (data) => {
    if (typeof data === 'string') return ['string', 0];
    const bytes = data instanceof ArrayBuffer ? new Uint8Array(data)
      : ArrayBuffer.isView(data) ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength) : null;
    return bytes && bytes.length ? [bytes[0], bytes] : ['other', null];
  };
  const Native = window.WebSocket;
  window.WebSocket = class extends Native {
    constructor(url, protocols) {
      super(url, protocols);
      const entry = {url: String(url), opened: false, closed: null};
      seen.sockets.push(entry);
      this.addEventListener('open', () => { entry.opened = true; });
      this.addEventListener('close', (e) => { entry.closed = [e.code, e.reason]; });
      this.addEventListener('message', (e) => {
        const [kind, bytes] = kindOf(e.data);
        seen.received[kind] = (seen.received[kind] || 0) + 1;
        if (seen.order.length < 6) seen.order.push(kind);
        if (kind === 1) seen.audioBytes += bytes.length - 1;
        if (kind === 2) seen.text.push(new TextDecoder().decode(bytes.subarray(1)));
        if (kind === 4 || kind === 5) seen.metadata.push([kind, new TextDecoder().decode(bytes.subarray(1))]);
      });
    }
    send(data) {
      const [kind] = kindOf(data);
      seen.sent[kind] = (seen.sent[kind] || 0) + 1;
      return super.send(data);
    }
  };
  const error = console.error.bind(console);
  console.error = (...args) => { seen.errors.push(args.map(String).join(' ').slice(0, 300)); error(...args); };
  window.addEventListener('error', (e) => seen.errors.push('uncaught: ' + e.message));
})();
"""

BUTTON = "[...document.querySelectorAll('button')].find(b => b.textContent.trim() === {!r})"
PLAYED = ("(() => { const cell = [...document.querySelectorAll('td')].find(td => td.textContent.trim() === "
          "'Audio played:'); if (!cell) return 0; const [m, s] = cell.nextElementSibling.textContent.split(':'); "
          "return 60 * Number(m) + Number(s); })()")


def _tone(path: Path, seconds: float = 1.0, rate: int = 48000) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.sin(2 * np.pi * 220 * t) * 0.3 * 32767).astype("<i2").tobytes())
    return path


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


def _serve_dist(directory: str) -> http.server.ThreadingHTTPServer:
    """The built client, as any static file server would serve it, on a loopback port."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=directory))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)


async def _wait_for_file(path: Path, pattern: str, what: str, timeout: float) -> re.Match:
    with trio.move_on_after(timeout):
        while not (found := re.search(pattern, path.read_text(errors="replace"))):
            await trio.sleep(0.1)
        return found
    raise AssertionError(f"timed out waiting for {what}; {path.name}:\n{path.read_text(errors='replace')[-3000:]}")


async def _open_watched(browser: Browser, url: str) -> ChromiumPage:
    """cdp.Browser.open, with WATCH added to the page before it loads."""
    parts = urlsplit(url)
    await browser.set_microphone(f"{parts.scheme}://{parts.netloc}", "granted")
    target = await browser.send("Target.createTarget", url="about:blank")
    attached = await browser.send("Target.attachToTarget", targetId=target["targetId"], flatten=True)
    page = ChromiumPage(browser, attached["sessionId"])
    await page.send("Emulation.setDeviceMetricsOverride", width=1100, height=900, deviceScaleFactor=1, mobile=False)
    await page.send("Page.enable")
    await page.send("Page.addScriptToEvaluateOnNewDocument", source=WATCH)
    await page.send("Page.navigate", url=url)
    await page.wait_for("document.readyState === 'complete'", f"{url} to load")
    return page


async def test_nvidia_personaplex_client_unmodified_sets_the_persona(tmp_path):
    started = time.monotonic()
    server_log = tmp_path / "serve.log"  # its start line and its log
    # With a transcriber (stt-tiny) too: the client, which never asks for the caller's words
    # (``/api/chat?input_text=1``), must get none, since its decoder throws on a kind it does not
    # know and logs every metadata message it cannot match (``protocols/moshi.py``).
    command = [str(Path(sys.executable).with_name("duplexrt")), "serve", "--config", "personaplex-tiny", "--port", "0",
               "--set", "runtime.slots=1", "--set", "metrics.log_stats=false", "-o", "warmup_steps=1",
               "--set", "transcriber.enabled=true", "--set", "transcriber.tiny=true"]
    with server_log.open("wb") as log:
        server = await trio.lowlevel.open_process(command, stdout=log, stderr=subprocess.STDOUT,
                                                  env=os.environ | {"NO_TORCH_COMPILE": "1"})
    assert DIST is not None
    dist = _serve_dist(DIST)
    try:
        up = await _wait_for_file(server_log, r"Listening on 127\.0\.0\.1 port\(s\) (\d+)", "the server to start",
                                  timeout=60)
        port = int(up.group(1))
        base = f"http://127.0.0.1:{port}"
        stats = await trio.to_thread.run_sync(_get_json, f"{base}/stats")
        assert stats["transcriber"] == {"model": "stt-tiny"}
        before = stats["persona"]
        assert "NATM1" in before["voices"]
        cache_before = before["prompt_cache"]

        page_url = f"http://127.0.0.1:{dist.server_address[1]}/?worker_addr=127.0.0.1:{port}"
        async with open_browser(_tone(tmp_path / "tone.wav")) as browser:
            page = await _open_watched(browser, page_url)
            await page.wait_for("!!(document.getElementById('text-prompt') && document.getElementById('voice-prompt'))",
                                "the client's form")
            options = await page.evaluate("[...document.getElementById('voice-prompt').options].map(o => o.value)")
            assert VOICE in options and all(name.removesuffix(".pt") in before["voices"] for name in options)
            # Typed and picked as a person would: React reads the value its input/change events carry.
            await page.evaluate(
                "(() => { const box = document.getElementById('text-prompt');"
                " Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, 'value').set.call(box, %s);"
                " box.dispatchEvent(new Event('input', {bubbles: true}));"
                " const voice = document.getElementById('voice-prompt');"
                " Object.getOwnPropertyDescriptor(HTMLSelectElement.prototype, 'value').set.call(voice, %s);"
                " voice.dispatchEvent(new Event('change', {bubbles: true})); })()"
                % (json.dumps(PROMPT), json.dumps(VOICE)))
            await page.wait_for(f"document.body.textContent.includes('{len(PROMPT)}/1000')", "the prompt typed")
            await page.evaluate(BUTTON.format("Connect") + ".click()")

            # NVIDIA's server sends the handshake once the prompt has run; the page is connected then.
            await page.wait_for("window.__nv.received[0] && !!" + BUTTON.format("Disconnect"),
                                "the handshake and the page connected", timeout=30)
            await page.wait_for(f"{PLAYED} >= 2 && (window.__nv.sent[1] || 0) > 10",
                                "two seconds of the model played, the microphone sent", timeout=30)
            seen = await page.evaluate("window.__nv")
            shown = await page.evaluate("document.querySelector('.player-text').textContent")
            played = await page.evaluate(PLAYED)
            await page.screenshot(tmp_path / "nvidia-client.png")

            assert len(seen["sockets"]) == 1, seen["sockets"]
            url = urlsplit(seen["sockets"][0]["url"])
            query = {key: values[-1] for key, values in parse_qs(url.query, keep_blank_values=True).items()}
            assert (url.scheme, url.netloc, url.path) == ("ws", f"127.0.0.1:{port}", "/api/chat")
            assert query["text_prompt"] == PROMPT and query["voice_prompt"] == VOICE
            assert seen["sockets"][0]["opened"] and seen["sockets"][0]["closed"] is None
            # The handshake first, then the server's metadata, then the model's audio (Ogg Opus).
            assert seen["order"][:2] == [0, 4] and seen["received"]["1"] > 10 and seen["audioBytes"] > 1000
            assert "string" not in seen["received"] and "5" not in seen["received"]  # (JSON: keys are strings)
            # The metadata is JSON (the page parses it; its server-info panel wants Kyutai's Rust
            # server's fields and stays empty, a logged schema mismatch, nothing else).
            bodies = [json.loads(body) for kind, body in seen["metadata"] if kind == 4]
            assert all(isinstance(body, dict) for body in bodies)
            assert not [body for body in bodies if body.get("type") == "input_text"]  # it did not ask
            assert set(seen["received"]) <= {"0", "1", "2", "4"}  # only kinds its decoder knows
            assert not [error for error in seen["errors"] if error.startswith("uncaught")], seen["errors"]
            # The page shows the model's text as it came (the tiny random model's gibberish).
            assert seen["received"].get("2", 0) > 0 and shown and shown == "".join(seen["text"])

            # The persona reached the model: a new one is a prompt-cache miss, prefilled.
            after = (await trio.to_thread.run_sync(_get_json, f"{base}/stats"))["persona"]["prompt_cache"]
            assert after["misses"] == cache_before["misses"] + 1
            assert after["prefills"] == cache_before["prefills"] + 1 and after["hits"] == cache_before["hits"]
            assert after["entries"] == cache_before["entries"] + 1
            opened = await _wait_for_file(server_log, r"session (\S+) opened", "the log's session opened", 5)

            await page.evaluate(BUTTON.format("Disconnect") + ".click()")
            hung_up = time.monotonic()
            # The server reads the Close after the microphone audio sent before it: on a machine
            # too busy for the model to keep real time that is seconds of backlog (one run here, on
            # a loaded 2-core box: over 15 s), so the close is given time.
            await page.wait_for("window.__nv.sockets[0].closed", "the socket closed", timeout=45)
            closed = await page.evaluate("window.__nv.sockets[0].closed")
            close_s = time.monotonic() - hung_up
            assert closed[0] in (1000, 1005), closed
            await _wait_for_file(server_log, rf"session {re.escape(opened.group(1))} ended: client_closed",
                                 "the log's session ended by the client", timeout=15)
            await page.wait_for("!!" + BUTTON.format("New Conversation"), "the page to offer a new conversation")

        # The server read the persona exactly as typed (the page's '+' for a space, '%26' for '&'):
        # the same prompt and voice, spelt otherwise on /v1/duplex, is a prompt-cache hit.
        duplex = f"ws://127.0.0.1:{port}/v1/duplex?instructions={quote(PROMPT)}&voice={VOICE.removesuffix('.pt')}"
        async with trio_websocket.open_websocket_url(duplex) as ws:
            created = json.loads(await ws.get_message())
            assert created["type"] == "session.created", created
            assert created["persona"]["instructions"] == PROMPT and created["persona"]["voice"] == "NATM1"
            with trio.fail_after(15):
                while (again := (await trio.to_thread.run_sync(_get_json, f"{base}/stats"))["persona"]
                       ["prompt_cache"])["hits"] == after["hits"]:
                    await trio.sleep(0.2)
            assert again["hits"] == after["hits"] + 1 and again["prefills"] == after["prefills"], again
        print(f"\nNVIDIA client: played {played:.2f} s; messages by kind {seen['received']} received, "
              f"{seen['sent']} sent; metadata {seen['metadata'][:1]}; text {shown!r}; prompt cache {cache_before}"
              f" -> {after} -> {again}; closed {closed} {close_s:.1f} s after Disconnect; {len(seen['errors'])} console"
              f" error(s), the first {seen['errors'][:1]!r:.120}; {time.monotonic() - started:.1f} s in all")
        log = server_log.read_text(errors="replace")
        print("\n".join(line for line in log.splitlines() if " opened: " in line or " ended: " in line))
        if os.environ.get("DUPLEXRT_SCREENSHOTS"):
            shutil.copy(tmp_path / "nvidia-client.png", Path(os.environ["DUPLEXRT_SCREENSHOTS"]) / "nvidia-client.png")
    finally:
        dist.shutdown()
        with trio.CancelScope(shield=True):
            if server.poll() is None:
                server.send_signal(signal.SIGINT)
                with trio.move_on_after(15):
                    await server.wait()
                if server.poll() is None:
                    server.kill()
            await server.wait()
