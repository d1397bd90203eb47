"""Configuration: defaults, validation messages, overrides, file errors, and backend options."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from duplexrt.backends import create_backend
from duplexrt.backends.echo import EchoBackend
from duplexrt.backends.synthetic import SyntheticBackend
from duplexrt.config import ConfigError, load_config

REPO = Path(__file__).parent.parent
DEFAULT_TOML = REPO / "configs" / "default.toml"


def names_number(message: str, number: str) -> bool:
    """True when ``number`` appears in ``message`` as a whole number (not inside another one)."""
    return re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", message) is not None


def mentions(message: str, word: str | tuple[str, ...]) -> bool:
    """``word`` (a number, a name, or a tuple of acceptable spellings) appears in ``message``."""
    if isinstance(word, tuple):
        return any(mentions(message, w) for w in word)
    if re.fullmatch(r"[\d.e+-]+", word):
        return names_number(message, word)
    return word in message


# -- defaults ----------------------------------------------------------------------------------


def test_builtin_defaults_have_documented_values():
    config = load_config()
    assert config.audio.sample_rate == 24000
    assert config.audio.frame_size == 1920
    assert config.runtime.slots == 128
    assert config.runtime.offload == "counted"
    assert config.backend.name == "echo"


def test_default_toml_matches_builtin_defaults_section_by_section():
    from_file = load_config(DEFAULT_TOML)
    builtin = load_config()
    assert from_file.audio == builtin.audio
    assert from_file.runtime == builtin.runtime
    assert from_file.backend.name == builtin.backend.name


def test_default_toml_equals_builtin_defaults():
    # configs/default.toml calls itself "duplexrt's defaults, spelled out".
    assert load_config(DEFAULT_TOML).to_dict() == load_config().to_dict()


def test_default_toml_and_builtin_defaults_build_the_same_echo_backend():
    from_file = create_backend(load_config(DEFAULT_TOML))
    builtin = create_backend(load_config())
    assert isinstance(from_file, EchoBackend) and isinstance(builtin, EchoBackend)
    assert from_file.delay_frames == builtin.delay_frames


def test_default_toml_allows_switching_backend_by_override():
    # default.toml says to copy it or override any key with --set; switching the backend must work.
    config = load_config(DEFAULT_TOML, ['backend.name="synthetic"'])
    assert isinstance(create_backend(config), SyntheticBackend)


# -- invalid values ------------------------------------------------------------------------------

INVALID = [
    # (override, full key, words the message must contain)
    ("runtime.slots=0", "runtime.slots", ["1", "4096"]),
    ("runtime.slots=5000", "runtime.slots", ["1", "4096"]),
    ('runtime.slots="16"', "runtime.slots", ["1", "4096"]),
    ("runtime.slots=16.0", "runtime.slots", ["1", "4096"]),
    ("runtime.slots=true", "runtime.slots", ["1", "4096"]),
    ("runtime.inbox_depth=0", "runtime.inbox_depth", ["1", "1024"]),
    ("runtime.inbox_depth=1025", "runtime.inbox_depth", ["1", "1024"]),
    ("runtime.outbox_depth=0", "runtime.outbox_depth", ["1", "1024"]),
    ("runtime.outbox_depth=2000", "runtime.outbox_depth", ["1", "1024"]),
    ("runtime.gather_window_ms=-1", "runtime.gather_window_ms", ["0", "1000"]),
    ("runtime.gather_window_ms=1000.5", "runtime.gather_window_ms", ["0", "1000"]),
    ("runtime.gather_window_ms=nan", "runtime.gather_window_ms", ["0", "1000"]),
    ('runtime.gather_window_ms="2"', "runtime.gather_window_ms", ["0", "1000"]),
    ("runtime.gather_window_ms=false", "runtime.gather_window_ms", ["0", "1000"]),
    ('runtime.offload="sometimes"', "runtime.offload", ["counted", "always"]),
    ("runtime.offload=1", "runtime.offload", ["counted", "always"]),
    ("audio.sample_rate=true", "audio.sample_rate", ["8000", "192000"]),
    ("audio.sample_rate=7999", "audio.sample_rate", ["8000", "192000"]),
    ("audio.sample_rate=192001", "audio.sample_rate", ["8000", "192000"]),
    ('audio.sample_rate="24000"', "audio.sample_rate", ["8000", "192000"]),
    ("audio.frame_size=0", "audio.frame_size", ["1", "192000"]),
    ("audio.frame_size=1920.5", "audio.frame_size", ["1", "192000"]),
]


@pytest.mark.parametrize(("override", "key", "words"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_override_names_key_and_allowed_values(override, key, words):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    message = str(caught.value)
    assert key in message
    for word in words:
        assert mentions(message, word), f"{word!r} missing from {message!r}"


@pytest.mark.parametrize(
    ("toml", "key", "words"),
    [
        ("[runtime]\nslots = 0\n", "runtime.slots", ["1", "4096"]),
        ("[runtime]\ngather_window_ms = -1\n", "runtime.gather_window_ms", ["0", "1000"]),
        ('[runtime]\noffload = "sometimes"\n', "runtime.offload", ["counted", "always"]),
        ("[audio]\nsample_rate = true\n", "audio.sample_rate", ["8000", "192000"]),
        ('[audio]\nframe_size = "big"\n', "audio.frame_size", ["1", "192000"]),
    ],
)
def test_invalid_value_in_file_names_key_range_and_file(tmp_path, toml, key, words):
    path = tmp_path / "bad-value.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert key in message
    assert str(path) in message
    for word in words:
        assert mentions(message, word), f"{word!r} missing from {message!r}"


def test_invalid_value_message_shows_the_value_given():
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["runtime.slots=5000"])
    assert names_number(str(caught.value), "5000")


@pytest.mark.parametrize(
    ("override", "expected"),
    [("runtime.slots=1", 1), ("runtime.slots=4096", 4096), ("runtime.inbox_depth=1024", 1024),
     ("runtime.gather_window_ms=0", 0), ("runtime.gather_window_ms=1000", 1000),
     ("runtime.gather_window_ms=7", 7), ("runtime.gather_window_ms=0.25", 0.25),
     ("audio.sample_rate=8000", 8000), ("audio.sample_rate=192000", 192000), ("audio.frame_size=1", 1),
     ('runtime.offload="always"', "always")],
)
def test_boundary_values_are_accepted(override, expected):
    section, name = override.partition("=")[0].split(".")
    config = load_config(None, [override])
    assert getattr(getattr(config, section), name) == expected


# -- unknown sections and keys ---------------------------------------------------------------------


def test_unknown_section_in_file_is_named(tmp_path):
    path = tmp_path / "extra.toml"
    path.write_text("[network]\nport = 8080\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "network" in str(caught.value)


def test_unknown_key_in_file_is_named_in_full(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text("[runtime]\nslot = 4\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "runtime.slot" in message
    assert "slots" in message  # the allowed keys are listed, so the typo is easy to fix


def test_unknown_key_by_override_is_named_in_full():
    with pytest.raises(ConfigError, match=re.escape("audio.channels")):
        load_config(None, ["audio.channels=2"])


def test_unknown_section_by_override_is_named():
    with pytest.raises(ConfigError, match="network"):
        load_config(None, ["network.port=8080"])


def test_section_that_is_not_a_table_is_refused(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text("runtime = 4\n")
    with pytest.raises(ConfigError, match="runtime"):
        load_config(path)


def test_backend_options_that_are_not_a_table_are_refused_with_config_error():
    with pytest.raises(ConfigError, match=re.escape("backend.options")):
        load_config(None, ["backend.options=3"])


def test_backend_options_given_as_a_string_are_refused_with_config_error():
    with pytest.raises(ConfigError, match=re.escape("backend.options")):
        load_config(None, ['backend.options="fast"'])


def test_backend_name_that_is_not_a_string_is_refused_with_config_error():
    with pytest.raises(ConfigError, match=re.escape("backend.name")):
        create_backend(load_config(None, ['backend.name=["echo"]']))


# -- overrides ------------------------------------------------------------------------------------


def test_overrides_apply_with_toml_typing():
    config = load_config(None, ["runtime.slots=16", "backend.options.step_ms=2.5", 'backend.name="synthetic"'])
    assert config.runtime.slots == 16 and type(config.runtime.slots) is int
    assert config.backend.options == {"step_ms": 2.5}
    assert type(config.backend.options["step_ms"]) is float
    assert config.backend.name == "synthetic"
    # Everything not overridden keeps its default.
    defaults = load_config()
    assert config.audio == defaults.audio
    assert config.runtime.inbox_depth == defaults.runtime.inbox_depth


def test_override_applies_on_top_of_a_file(tmp_path):
    path = tmp_path / "base.toml"
    path.write_text("[runtime]\nslots = 32\ninbox_depth = 4\n")
    config = load_config(path, ["runtime.slots=64"])
    assert config.runtime.slots == 64
    assert config.runtime.inbox_depth == 4


def test_later_override_of_the_same_key_wins():
    config = load_config(None, ["runtime.slots=16", "runtime.slots=3"])
    assert config.runtime.slots == 3


def test_override_with_bare_word_is_read_as_a_string():
    assert load_config(None, ["runtime.offload=always"]).runtime.offload == "always"


def test_override_tolerates_spaces_around_equals():
    assert load_config(None, ["runtime.slots = 16"]).runtime.slots == 16


def test_override_into_backend_options_keeps_file_options(tmp_path):
    path = tmp_path / "synth.toml"
    path.write_text('[backend]\nname = "synthetic"\n[backend.options]\nslot_us = 5.0\n')
    config = load_config(path, ["backend.options.step_ms=2.5"])
    assert config.backend.options == {"slot_us": 5.0, "step_ms": 2.5}


@pytest.mark.parametrize("override", ["runtime.slots", "=16", "slots=16", ""])
def test_malformed_override_is_refused(override):
    with pytest.raises(ConfigError):
        load_config(None, [override])


def test_override_into_a_value_that_is_not_a_table_is_refused(tmp_path):
    path = tmp_path / "base.toml"
    path.write_text("[runtime]\nslots = 32\n")
    with pytest.raises(ConfigError, match=re.escape("runtime.slots")):
        load_config(path, ["runtime.slots.deeper=1"])


# -- files ---------------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere" / "missing.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value)


def test_bad_toml_names_the_path(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[runtime\nslots = = 4\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value)


def test_file_that_is_not_utf8_gives_config_error_naming_the_path(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[backend]\nname = "\xe9cho"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value)


def test_path_that_is_a_directory_gives_config_error_naming_the_path(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    assert str(tmp_path) in str(caught.value)


def test_path_accepts_str_as_well_as_path(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text("[runtime]\nslots = 2\n")
    assert load_config(str(path)).runtime.slots == 2


def test_empty_file_gives_the_defaults(tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text("")
    assert load_config(path) == load_config()


# -- create_backend --------------------------------------------------------------------------------


def test_create_backend_refuses_unknown_name():
    config = load_config(None, ['backend.name="whisper"'])
    with pytest.raises(ConfigError) as caught:
        create_backend(config)
    message = str(caught.value)
    assert "backend.name" in message
    assert "whisper" in message
    assert "echo" in message and "synthetic" in message


@pytest.mark.parametrize(
    ("name", "option"),
    [("echo", "gain"), ("echo", "step_ms"), ("synthetic", "delay_frames"), ("synthetic", "volume")],
)
def test_create_backend_refuses_unknown_option_naming_full_key(name, option):
    config = load_config(None, [f'backend.name="{name}"', f"backend.options.{option}=1"])
    with pytest.raises(ConfigError) as caught:
        create_backend(config)
    assert f"backend.options.{option}" in str(caught.value)


OUT_OF_RANGE = [
    ("echo", "delay_frames=-1", "delay_frames", ["0", "1000"]),
    ("echo", "delay_frames=1001", "delay_frames", ["0", "1000"]),
    ("echo", "delay_frames=2.5", "delay_frames", ["0", "1000"]),
    ("echo", "delay_frames=true", "delay_frames", ["0", "1000"]),
    ("echo", 'delay_frames="2"', "delay_frames", ["0", "1000"]),
    ("synthetic", "step_ms=-1", "step_ms", ["0", "60000"]),
    ("synthetic", "step_ms=60001", "step_ms", ["0", "60000"]),
    ("synthetic", "step_ms=nan", "step_ms", ["0", "60000"]),
    ("synthetic", 'step_ms="fast"', "step_ms", ["0", "60000"]),
    ("synthetic", "slot_us=-0.5", "slot_us", ["0", ("1e+06", "1000000", "1,000,000")]),
]


@pytest.mark.parametrize(
    ("name", "option", "key", "words"), OUT_OF_RANGE, ids=[f"{c[0]}-{c[1]}" for c in OUT_OF_RANGE]
)
def test_create_backend_refuses_out_of_range_option_naming_key_and_range(name, option, key, words):
    config = load_config(None, [f'backend.name="{name}"', f"backend.options.{option}"])
    with pytest.raises(ConfigError) as caught:
        create_backend(config)
    message = str(caught.value)
    assert f"backend.options.{key}" in message
    for word in words:
        assert mentions(message, word), f"{word!r} missing from {message!r}"


def test_create_backend_uses_audio_and_runtime_settings():
    config = load_config(None, ['backend.name="synthetic"', "backend.options.step_ms=2.5",
                                "runtime.slots=6", "audio.frame_size=480", "audio.sample_rate=16000"])
    backend = create_backend(config)
    assert isinstance(backend, SyntheticBackend)
    assert backend.info.slots == 6
    assert backend.info.frame_size == 480
    assert backend.info.sample_rate == 16000
    assert backend.info.name == "synthetic"
    assert backend.step_seconds == pytest.approx(0.0025)


def test_create_backend_echo_takes_delay_option():
    backend = create_backend(load_config(None, ["runtime.slots=2", "backend.options.delay_frames=7"]))
    assert isinstance(backend, EchoBackend)
    assert backend.delay_frames == 7
