"""The talk page and the dashboard in real browsers: headless Chromium over DevTools, headless
Firefox over WebDriver BiDi.

Chromium's fake microphone plays a WAV tone, Firefox's a tone of its own; the tests check what
the page itself counts (``window.duplexrt``, ``window.dashboard``) and what it shows.  With DUPLEXRT_SCREENSHOTS=DIR
the screenshots of both pages are kept there (docs/ holds the README's).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import ssl
import wave
from pathlib import Path

import numpy as np
import pytest
import trio
import trio_websocket

from bidi import FIREFOX, open_browser as open_firefox
from cdp import CHROMIUM, open_browser
from conftest import backend_info, wait_until
from duplexrt import presets
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import load_config
from duplexrt.server import Server
from pulse import PULSEAUDIO

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (CI installs Debian's)")
needs_firefox = pytest.mark.skipif(FIREFOX is None, reason="no Firefox on this machine (CI installs Debian's firefox-esr)")
needs_personaplex = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("moshi") is None,
    reason="the personaplex-tiny preset needs torch and moshi")
needs_pulseaudio = pytest.mark.skipif(PULSEAUDIO is None, reason="no PulseAudio on this machine, for headless Firefox's"
                                      " audio output (CI installs Debian's pulseaudio)")


class SpeakingEcho(EchoBackend):
    """FAKE: the real echo model, plus a word of 'model text' every fourth step of each slot, so
    the page's text panel has something to show without a language model."""

    def __init__(self, config):
        super().__init__(backend_info(config, "echo"), {"delay_frames": 2})
        self.steps = np.zeros(config.runtime.slots, dtype=np.int64)

    def open_slot(self, slot, session):
        super().open_slot(slot, session)
        self.steps[slot] = 0

    def step(self, rows, inputs, outputs):
        super().step(rows, inputs, outputs)
        self.steps[rows] += 1
        return ["hello " if self.steps[row] % 4 == 0 else "" for row in rows]


def _tone(path: Path, seconds: float = 1.0, rate: int = 48000) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (np.sin(2 * np.pi * 440 * t) * 0.5 * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return path


async def _server(nursery: trio.Nursery, *overrides: str, backend=None) -> Server:
    config = load_config(None, ["server.port=0", "runtime.slots=4", *overrides])
    server = Server(config, backend(config) if backend else None)
    await nursery.start(server.run)
    return server


def _keep(shot: Path) -> None:
    where = os.environ.get("DUPLEXRT_SCREENSHOTS")
    if where:
        shutil.copy(shot, Path(where) / shot.name)


@needs_chromium
async def test_talk_page_echoes_the_microphone_shows_text_and_the_dashboard_sees_it(nursery, tmp_path):
    server = await _server(nursery, backend=SpeakingEcho)
    base = f"http://127.0.0.1:{server.ports[0]}"
    rate = server.config.audio.sample_rate
    async with open_browser(_tone(tmp_path / "tone.wav")) as browser:
        talk = await browser.open(f"{base}/")
        await talk.wait_for("window.duplexrt.server", "the page to read /stats")
        await talk.evaluate("document.getElementById('start').click()")
        await talk.wait_for(f"duplexrt.playedSamples > {rate} && duplexrt.textPieces > 2",
                            "a second of echo played and some text")
        state = await talk.evaluate("window.duplexrt")
        assert state["error"] is None and state["state"] == "talking"
        assert state["sentSamples"] >= rate
        # The tone came back as a tone, not silence, and was played through the jitter buffer.
        assert state["receivedPeak"] > 0.1 and state["playedPeak"] > 0.1
        assert 0 < state["ttfaMs"] < 5000 and 0 < state["lagMs"] < 5000
        assert "hello hello" in await talk.evaluate("document.getElementById('text').textContent")
        # No transcriber: no panel for the caller's words, the page as it always was.
        assert await talk.evaluate("[document.getElementById('callerpanel').hidden, duplexrt.transcriber, "
                                   "document.getElementById('texts').className]") == [True, None, "texts"]

        dashboard = await browser.open(f"{base}/dashboard")
        await dashboard.wait_for("dashboard.readings >= 3 && dashboard.current.stepsPerSecond > 0",
                                 "three dashboard readings while the session runs")
        board = await dashboard.evaluate("window.dashboard")
        assert board["last"]["sessions_active"] == 1 and board["last"]["slots"] == 4
        assert board["current"]["batch"] > 0
        # Sessions / capacity / slots: the echo model costs nothing, so capacity is every slot.
        assert await dashboard.evaluate("document.getElementById('sessions').textContent") == "1 / 4 / 4"
        assert server.runtime.metrics.sessions_active == 1

        await talk.evaluate("document.getElementById('stop').click()")
        await talk.wait_for("duplexrt.state === 'idle'", "the session to end")
    assert server.runtime.metrics.sessions_opened == 1


@needs_chromium
async def test_the_pages_on_the_real_echo_model_have_their_icon_and_explain_the_dashboard(nursery, tmp_path):
    """The README's screenshots come from here: the echo model as `duplexrt serve` runs it (no
    text: echo has none), so what they show is what its page shows."""
    server = await _server(nursery)
    base = f"http://127.0.0.1:{server.ports[0]}"
    rate = server.config.audio.sample_rate
    async with open_browser(_tone(tmp_path / "tone.wav")) as browser:
        talk = await browser.open(f"{base}/")
        await talk.wait_for("window.duplexrt.server", "the page to read /stats")
        # The icon the page names is there (no 404 in the console for it).
        icon = await talk.evaluate("fetch(document.querySelector('link[rel=icon]').href)"
                                   ".then(r => [r.status, r.headers.get('content-type')])")
        assert icon == [200, "image/svg+xml"]
        await talk.evaluate("document.getElementById('start').click()")
        await talk.wait_for(f"duplexrt.playedSamples > {rate}", "a second of echo played")
        assert await talk.evaluate("document.getElementById('text').textContent.trim()") == ""
        assert "backend echo" in await talk.evaluate("document.getElementById('info').textContent")
        assert await talk.evaluate("document.getElementById('persona').hidden")  # echo takes no persona
        dashboard = await browser.open(f"{base}/dashboard", height=1120)  # every panel in the shot
        await dashboard.wait_for("dashboard.readings >= 6 && dashboard.current.stepsPerSecond > 0",
                                 "dashboard readings while the session runs")
        # Every panel says in a line what it shows (the prompt cache's stays hidden: echo takes no persona).
        panels = await dashboard.evaluate(
            "[...document.querySelectorAll('.panel')].filter(p => !p.hidden)"
            ".map(p => [p.querySelector('h2').textContent, "
            "(p.querySelector('.explain') || {}).textContent || ''])")
        assert len(panels) == 8 and all(len(text) > 30 for _, text in panels), panels
        await talk.wait_for("duplexrt.lagMs !== null && document.getElementById('lag').textContent !== '–'",
                            "the lag tile")
        await talk.screenshot(tmp_path / "talk-page.png")
        await dashboard.screenshot(tmp_path / "dashboard.png")
        await talk.evaluate("document.getElementById('stop').click()")
        await talk.wait_for("duplexrt.state === 'idle'", "the session to end")
    for shot in ("talk-page.png", "dashboard.png"):
        assert (tmp_path / shot).read_bytes().startswith(b"\x89PNG")
        _keep(tmp_path / shot)


@needs_chromium
async def test_talk_page_with_an_api_key_a_full_server_and_a_denied_microphone(nursery, tmp_path):
    server = await _server(nursery, 'server.api_key="s3cret"', "runtime.slots=1", "backend.options.delay_frames=0")
    port = server.ports[0]
    base = f"http://127.0.0.1:{port}"
    start = "document.getElementById('start').click()"
    async with open_browser(_tone(tmp_path / "tone.wav")) as browser:
        talk = await browser.open(f"{base}/")
        await talk.wait_for("!document.getElementById('keyrow').hidden", "the page to ask for a key")
        await talk.evaluate(f"document.getElementById('key').value = 'wrong'; {start}")
        error = await talk.wait_for("duplexrt.state === 'failed' && duplexrt.error", "the wrong key to be refused")
        assert "refused the API key" in error and server.refused["unauthorized"] == 1

        await talk.evaluate("document.getElementById('key').value = 's3cret'")
        await browser.set_microphone(base, "denied")
        await talk.evaluate(f"duplexrt.error = null; {start}")
        error = await talk.wait_for("duplexrt.state === 'failed' && duplexrt.error", "the microphone to be denied")
        assert "Microphone access was denied" in error
        await browser.set_microphone(base, "granted")

        async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/v1/duplex",
                                                     extra_headers=[("Authorization", "Bearer s3cret")]):
            await talk.evaluate(f"duplexrt.error = null; {start}")
            error = await talk.wait_for("duplexrt.state === 'failed' && duplexrt.error", "the full server")
            assert "The server is full" in error
        await wait_until(lambda: server.runtime.metrics.sessions_active == 0, "the other session to end")

        await talk.evaluate(f"duplexrt.error = null; {start}")
        await talk.wait_for(f"duplexrt.receivedSamples > {server.config.audio.sample_rate // 2}",
                            "echo with the right key")
        assert "s3cret" not in await talk.evaluate("location.href")
        assert server.refused["unauthorized"] == 1


PIRATE = "You are Lou, a pirate & boat seller (50% off?) in a harbour town: say « ahoy » #1 + smile."


@needs_chromium
@needs_personaplex
async def test_talk_page_offers_the_persona_of_personaplex_tiny_and_the_call_takes_it(nursery, tmp_path):
    """The real ``personaplex-tiny`` preset (a persona per call, on the CPU): the page offers its
    voices and its default prompt, sends the ones chosen URL-encoded, and the server takes them
    (``session.created`` names them; the prompt cache counts a new persona, prefilled); the
    dashboard shows the cache.  A prompt the model refuses is said to be refused.  The README's
    ``docs/talk-page-persona.png`` comes from here.  The model steps on one torch thread, beside
    the browser: on a busy machine a call may still fall behind, so its end is given time."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        await _persona_on_the_talk_page(nursery, tmp_path)
    finally:
        torch.set_num_threads(threads)


async def _persona_on_the_talk_page(nursery, tmp_path):
    config = load_config(presets.resolve("personaplex-tiny"),
                         ["server.port=0", "runtime.slots=2", "metrics.log_stats=false",
                          "backend.options.warmup_steps=1"])
    server = Server(config)
    await nursery.start(server.run)
    offer = server.statistics().runtime.persona
    assert offer is not None and "NATM1" in offer["voices"]
    base = f"http://127.0.0.1:{server.ports[0]}"
    rate = config.audio.sample_rate
    start = "document.getElementById('start').click()"
    async with open_browser(_tone(tmp_path / "tone.wav")) as browser:
        talk = await browser.open(f"{base}/", height=900)
        await talk.wait_for("!document.getElementById('persona').hidden", "the persona box")
        assert await talk.evaluate("[...document.getElementById('voice').options].map(o => o.value)") == \
            offer["voices"]
        assert await talk.evaluate("document.getElementById('voice').value") == offer["default_voice"]
        assert await talk.evaluate("document.getElementById('instructions').value") == offer["default_instructions"]
        hint = await talk.evaluate("document.getElementById('prompthint').textContent")
        assert f"{len(offer['default_instructions'])} characters" in hint and "at most 384 tokens" in hint

        # A character that is not text is caught on the page, before any connection.
        await talk.evaluate("document.getElementById('instructions').value = 'ring \\u0007 the bell'; " + start)
        error = await talk.wait_for("duplexrt.state === 'failed' && duplexrt.error", "the page to refuse U+0007")
        assert "not text (U+0007" in error and server.runtime.metrics.sessions_opened == 0

        await talk.evaluate(f"document.getElementById('voice').value = 'NATM1'; "
                            f"const box = document.getElementById('instructions'); box.value = {PIRATE!r}; "
                            "box.dispatchEvent(new Event('input')); duplexrt.error = null; " + start)
        await talk.wait_for(f"duplexrt.persona && duplexrt.receivedSamples > {rate}", "the call, a second of it",
                            timeout=30)
        state = await talk.evaluate("window.duplexrt")
        assert state["error"] is None and state["state"] == "talking"
        # What the server says it took: the voice and the prompt, exactly as chosen.
        assert state["persona"]["voice"] == "NATM1" and state["persona"]["instructions"] == PIRATE
        assert state["persona"]["prompt_tokens"] > 0
        assert await talk.evaluate("[document.getElementById('instructions').disabled, "
                                   "document.getElementById('voice').disabled]") == [True, True]
        # The model ran that prompt: a new persona is a miss and a prefill (the default was the first).
        cache = server.statistics().runtime.persona["prompt_cache"]
        assert cache["misses"] == 1 and cache["hits"] == 0 and cache["prefills"] == 2

        dashboard = await browser.open(f"{base}/dashboard", height=1300)
        await dashboard.wait_for("!document.getElementById('promptcache').hidden && dashboard.promptCache",
                                 "the prompt cache panel")
        board = await dashboard.evaluate("dashboard.promptCache")
        assert board["misses"] == 1 and board["prefills"] == 2 and board["hitRate"] == 0
        table = await dashboard.evaluate("document.getElementById('cache').textContent")
        assert "hit rate0.0 %" in table and "of 64.0 MB" in table

        await talk.wait_for("document.getElementById('lag').textContent !== '–'", "the lag tile")
        await talk.screenshot(tmp_path / "talk-page-persona.png")
        await talk.evaluate("document.getElementById('stop').click()")
        await talk.wait_for("duplexrt.state === 'idle'", "the call to end", timeout=60)
        assert await talk.evaluate("document.getElementById('instructions').disabled") is False
        assert "last call: %d tokens" % state["persona"]["prompt_tokens"] in \
            await talk.evaluate("document.getElementById('prompthint').textContent")

        # A prompt over the model's 384 tokens: the server refuses it (400) and the page says so.
        await talk.evaluate("document.getElementById('instructions').value = 'Talk like a pirate. '.repeat(60); "
                            + start)
        error = await talk.wait_for("duplexrt.state === 'failed' && duplexrt.error", "the long prompt refused")
        assert "refused the persona" in error and "at most 384 tokens" in error
        assert server.refused["bad_persona"] == 1
    assert server.runtime.metrics.sessions_opened == 1
    assert (tmp_path / "talk-page-persona.png").read_bytes().startswith(b"\x89PNG")
    _keep(tmp_path / "talk-page-persona.png")


def _varied(path: Path, seconds: float = 3.0, rate: int = 24000) -> Path:
    """A WAV whose every 80 ms differs (tones, noise, silence), as a caller's voice does: a tone
    held for seconds gives a speech-to-text model the same frame over and over."""
    rng = np.random.default_rng(7)
    frame = rate * 80 // 1000
    t = np.arange(frame) / rate
    pieces = []
    for i in range(int(seconds * rate) // frame):
        loud = rng.uniform(0.05, 0.6)
        tone = loud * np.sin(2 * np.pi * rng.uniform(120, 3000) * t) if i % 3 else np.zeros(frame)
        pieces.append(tone + (rng.standard_normal(frame) * loud * 0.5 if i % 4 == 0 else 0.0))
    pcm = (np.clip(np.concatenate(pieces), -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return path


@needs_chromium
@needs_personaplex
async def test_talk_page_shows_the_callers_words_beside_the_models_on_moshi_tiny_stt(nursery, tmp_path):
    """The real ``moshi-tiny-stt`` preset (the tiny Moshi and ``stt-tiny`` on the CPU): the page
    learns from ``/stats`` that the server transcribes its callers, shows a panel for the
    caller's words beside the model's, and fills it from ``/v1/duplex``'s ``input_text`` while
    the call runs.  ``docs/talk-page-transcript.png`` comes from here."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = load_config(presets.resolve("moshi-tiny-stt"),
                             ["server.port=0", "runtime.slots=1", "metrics.log_stats=false",
                              "backend.options.warmup_steps=1"])
        server = Server(config)
        await nursery.start(server.run)
        async with open_browser(_varied(tmp_path / "voice.wav")) as browser:
            talk = await browser.open(f"http://127.0.0.1:{server.ports[0]}/", height=900)
            await talk.wait_for("!document.getElementById('callerpanel').hidden", "the caller's panel")
            assert await talk.evaluate("duplexrt.transcriber") == {"model": "stt-tiny"}
            assert await talk.evaluate("document.getElementById('texts').className") == "texts both"
            await talk.evaluate("document.getElementById('start').click()")
            await talk.wait_for("duplexrt.callerPieces > 3 && duplexrt.textPieces > 3",
                                "the caller's words and the model's", timeout=60)
            # One read of the state and the panels together: pieces keep coming while the call runs.
            state, shown, model_text = await talk.evaluate(
                "[window.duplexrt, document.getElementById('callertext').textContent, "
                "document.getElementById('text').textContent]")
            assert state["error"] is None and state["state"] == "talking"
            assert shown == state["callerText"] and shown.strip()
            assert model_text == state["text"]
            await talk.screenshot(tmp_path / "talk-page-transcript.png")
            await talk.evaluate("document.getElementById('stop').click()")
            await talk.wait_for("duplexrt.state === 'idle'", "the call to end", timeout=60)
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "talk-page-transcript.png").read_bytes().startswith(b"\x89PNG")
    _keep(tmp_path / "talk-page-transcript.png")


@needs_firefox
@needs_pulseaudio
async def test_talk_page_in_firefox_echoes_the_microphone_and_shows_text(nursery):
    """Firefox plays the echo through a private PulseAudio null sink (tests/pulse.py): headless,
    with no audio server to reach, it never starts an AudioContext, and Debian's firefox-esr has
    no mock audio backend to stand in (the test below is that case)."""
    server = await _server(nursery, backend=SpeakingEcho)
    rate = server.config.audio.sample_rate
    async with open_firefox() as browser:
        talk = await browser.open(f"http://127.0.0.1:{server.ports[0]}/")
        await talk.wait_for("window.duplexrt.server", "the page to read /stats")
        await talk.evaluate("document.getElementById('start').click()")
        await talk.wait_for(f"duplexrt.playedSamples > {rate} && duplexrt.textPieces > 2",
                            "a second of echo played and some text")
        state = await talk.evaluate("window.duplexrt")
        assert state["error"] is None and state["state"] == "talking"
        assert state["sentSamples"] >= rate
        # Firefox's fake microphone is a tone at a tenth of full scale: it came back as that tone
        # (not silence) and went through the jitter buffer.
        assert 0.05 < state["receivedPeak"] <= 0.11 and 0.05 < state["playedPeak"] <= 0.11
        # Echo answers within a millisecond on loopback now that output leaves from the delivery,
        # and Firefox rounds its clock (reduced timer precision): a lag of 0 ms is measured, not missing.
        assert 0 < state["ttfaMs"] < 5000 and state["lagMs"] is not None and 0 <= state["lagMs"] < 5000
        assert "hello hello" in await talk.evaluate("document.getElementById('text').textContent")
        await talk.evaluate("document.getElementById('stop').click()")
        await talk.wait_for("duplexrt.state === 'idle'", "the session to end")
    assert server.runtime.metrics.sessions_opened == 1


@needs_firefox
async def test_talk_page_says_so_when_the_browser_cannot_start_audio(nursery):
    # With no audio server to reach (and no sound card), headless Firefox never starts an
    # AudioContext: resume() neither resolves nor rejects.  The page must say so and let go of
    # the microphone, not sit in "starting".
    server = await _server(nursery)
    async with open_firefox(audio_output=False) as browser:
        talk = await browser.open(f"http://127.0.0.1:{server.ports[0]}/")
        await talk.wait_for("window.duplexrt.server", "the page to read /stats")
        await talk.evaluate("document.getElementById('start').click()")
        error = await talk.wait_for("duplexrt.state === 'failed' && duplexrt.error", "the page to give up on audio",
                                    timeout=10)
        assert "could not start audio" in error
        assert not await talk.evaluate("document.getElementById('start').disabled")
    assert server.runtime.metrics.sessions_opened == 0


@needs_chromium
async def test_talk_page_over_tls_says_when_the_call_is_cut_and_when_the_server_drains(nursery, tmp_path):
    """Issue 40: the page over https:// and wss:// (``--ssl-certfile``); a cut connection is called
    one and the slot count follows it; a draining server is named as such."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    from test_tls import _make_cert, _tls_overrides

    cert, key = _make_cert(tmp_path, "server")
    server = await _server(nursery, *_tls_overrides(cert, key), "runtime.resume_window_s=0",
                           "backend.options.delay_frames=0")
    port, rate = server.ports[0], server.config.audio.sample_rate
    info = "document.getElementById('info').textContent"
    async with open_browser(_tone(tmp_path / "tone.wav")) as browser:
        await browser.send("Security.setIgnoreCertificateErrors", ignore=True)  # a self-signed certificate
        talk = await browser.open(f"https://127.0.0.1:{port}/")
        await talk.wait_for("window.duplexrt.server", "the page to read /stats over https")
        await talk.evaluate("document.getElementById('start').click()")
        await talk.wait_for(f"duplexrt.receivedSamples > {rate // 2}", "echo over wss://")
        await talk.wait_for(f"{info}.includes('1/4 slots in use')", "the slot count of the call")

        server.abort()  # every connection dropped, as a cut network does
        error = await talk.wait_for("duplexrt.state === 'failed' && duplexrt.error", "the cut to be noticed")
        assert "The connection to the server was cut" in error and "1006" not in error
        await talk.wait_for(f"{info}.includes('0/4 slots in use')", "the slot count without the cut call")

        ssl_context = ssl.create_default_context(cafile=cert)
        async with trio_websocket.open_websocket_url(f"wss://127.0.0.1:{port}/v1/duplex", ssl_context=ssl_context):
            server.shutdown()  # the drain waits for that call
            await talk.wait_for(f"{info}.includes('draining')", "the header to say the server drains")
            await talk.evaluate("duplexrt.error = null; document.getElementById('start').click()")
            error = await talk.wait_for("duplexrt.state === 'failed' && duplexrt.error", "a call refused by the drain")
            assert "The server is draining" in error
