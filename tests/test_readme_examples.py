"""The integrator guide's SDK examples (docs/integrator.md, linked from the README), as the guide
prints them, run against a real server.

The script is taken from the guide (the ``python`` block whose first line names
``openai_realtime_example.py``), written to a file and run in a process of its own with the
arguments its first line shows, as a reader would run it.  What it wrote is then compared with
what it sent: the echo model answers the turn with the very same audio.
"""

from __future__ import annotations

import re
import sys
import wave
from pathlib import Path

import numpy as np
import trio

from duplexrt.config import load_config
from duplexrt.server import Server

#: Where the examples live since the README became a quick start (issue 40).
README = Path(__file__).resolve().parent.parent / "docs" / "integrator.md"
KEY = "sk-readme"


def readme_block(first_line_contains: str) -> str:
    """The README's fenced ``python`` block whose first line holds ``first_line_contains``."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    found = [block for block in blocks if first_line_contains in block.split("\n", 1)[0]]
    assert len(found) == 1, f"{len(found)} README blocks start with {first_line_contains!r}"
    return found[0]


async def run_example(name: str, server: Server, samples: np.ndarray, folder: Path, *, patience: float) -> str:
    """The README's example ``name`` run as its first line shows, against ``server``, with
    ``samples`` (24 kHz pcm16) as ``in.wav`` in ``folder``: what it printed (it writes
    ``out.wav`` there)."""
    script = folder / name
    script.write_text(readme_block(name))
    with wave.open(str(folder / "in.wav"), "wb") as source:
        source.setnchannels(1)
        source.setsampwidth(2)
        source.setframerate(24000)
        source.writeframes(samples.tobytes())
    with trio.fail_after(patience):
        done = await trio.run_process(
            [sys.executable, str(script), f"http://127.0.0.1:{server.ports[0]}/v1", KEY,
             str(folder / "in.wav"), str(folder / "out.wav")], capture_stdout=True, capture_stderr=True,
            check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stdout.decode()


def test_the_readme_names_the_example_and_this_test():
    text = README.read_text()
    assert "tests/test_readme_examples.py" in text
    assert readme_block("openai_realtime_example.py").startswith("# openai_realtime_example.py: python ")


async def test_the_openai_sdk_example_sends_a_turn_and_writes_the_reply(nursery, tmp_path):
    config = load_config(None, ["server.port=0", "runtime.slots=2", "backend.options.delay_frames=0",
                                f'server.api_key="{KEY}"', "metrics.log_stats=false"])
    server = Server(config)
    await nursery.start(server.run)
    samples = (np.random.default_rng(29).standard_normal(24000 * 2) * 3000).astype("<i2")  # 2 s: 25 frames
    stdout = await run_example("openai_realtime_example.py", server, samples, tmp_path, patience=60)
    assert stdout.split() == ["completed", "25", "frames"]
    with wave.open(str(tmp_path / "out.wav")) as reply:
        assert (reply.getframerate(), reply.getnchannels(), reply.getsampwidth()) == (24000, 1, 2)
        heard = reply.readframes(reply.getnframes())
    assert heard == samples.tobytes(), "the echo model answers the turn with the same audio"


def test_the_readme_names_the_personaplex_example():
    assert readme_block("personaplex_example.py").startswith("# personaplex_example.py: python ")


async def test_the_personaplex_example_sets_its_persona_and_gets_a_reply(nursery, tmp_path):
    """The README's PersonaPlex example against ``personaplex-tiny``: the voice and the role prompt
    it asks for are the ones the server took, and the turn is answered frame for frame."""
    import pytest

    pytest.importorskip("moshi")
    from duplexrt import presets

    config = load_config(presets.path("personaplex-tiny"), ["server.port=0", "runtime.slots=2",
                                                            f'server.api_key="{KEY}"', "metrics.log_stats=false"])
    server = Server(config)
    await nursery.start(server.run)
    samples = (np.random.default_rng(31).standard_normal(24000) * 3000).astype("<i2")  # 1 s: 12.5 frames
    stdout = await run_example("personaplex_example.py", server, samples, tmp_path, patience=120)
    persona_line, reply_line = stdout.strip().splitlines()
    assert persona_line == "NATM1 | You are Lou, a patient pirate who sells second-hand boats."
    status, frames, _ = reply_line.split()
    assert status == "completed" and int(frames) >= 12
    with wave.open(str(tmp_path / "out.wav")) as reply:
        assert reply.getnframes() == int(frames) * 1920
    stats = server.statistics().runtime.persona
    assert stats is not None and stats["prompt_cache"]["misses"] == 1


def test_the_readme_names_the_streaming_and_duplex_sdk_examples():
    text = README.read_text()
    assert readme_block("openai_vad_example.py").startswith("# openai_vad_example.py: python ")
    assert readme_block("openai_duplex_example.py").startswith("# openai_duplex_example.py: python ")
    assert 'extra_query={"duplex": "1"}' in text


async def _echo_server(nursery) -> Server:
    config = load_config(None, ["server.port=0", "runtime.slots=2", "backend.options.delay_frames=0",
                                f'server.api_key="{KEY}"', "metrics.log_stats=false"])
    server = Server(config)
    await nursery.start(server.run)
    return server


async def test_the_server_vad_example_streams_speech_and_ends_with_the_answer(nursery, tmp_path):
    """The README's streaming sample: no turn_detection (server VAD), real speech at real-time
    pace, and a receiver that ends with the response to it; the echo model answers the turn with
    the speech it heard."""
    import speech

    voice = speech.speech_24k()
    samples = np.concatenate([np.zeros(12000, "<i2"), voice])  # the file ends as the speech does
    server = await _echo_server(nursery)
    stdout = await run_example("openai_vad_example.py", server, samples, tmp_path, patience=60)
    lines = stdout.strip().splitlines()
    assert any(line.startswith("speech stopped at") for line in lines), stdout
    status, frames, _ = lines[-1].split()
    assert status == "completed" and int(frames) >= len(voice) * 0.8 / 1920, stdout
    with wave.open(str(tmp_path / "out.wav")) as reply:
        assert reply.getnframes() >= len(voice) * 0.8


async def test_the_duplex_example_connects_with_extra_query_and_hears_the_model(nursery, tmp_path):
    """The README's duplex sample: ``extra_query={"duplex": "1"}`` on ``/v1`` (the SDK appends
    ``/realtime``); the model's speech comes back in bursts, each one response, and the receiver
    ends with the burst that answered the end of the file."""
    import speech

    voice = speech.speech_24k()
    samples = np.concatenate([np.zeros(12000, "<i2"), voice])
    server = await _echo_server(nursery)
    stdout = await run_example("openai_duplex_example.py", server, samples, tmp_path, patience=60)
    lines = stdout.strip().splitlines()
    assert lines[0].startswith("duplex session "), stdout
    assert lines[-1].split()[0] == "completed", stdout
    bursts = sum(int(line.split()[1]) for line in lines[1:])
    with wave.open(str(tmp_path / "out.wav")) as reply:
        heard = np.frombuffer(reply.readframes(reply.getnframes()), "<i2")
    assert bursts * 1920 >= len(heard) >= len(voice) * 0.8, stdout
