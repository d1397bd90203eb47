"""Model presets by name (``--config moshi-tiny``), ``duplexrt configs``, and ``--version``."""

from __future__ import annotations

import json
import socket
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

import duplexrt
from duplexrt import presets
from duplexrt.config import ConfigError, load_config
from duplexrt_cli.app import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_the_presets_are_the_files_of_the_configs_folder():
    assert presets.names() == sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))
    assert {"default", "moshi-tiny", "moshiko", "hibiki"} <= set(presets.names())


def test_a_name_resolves_to_its_preset_wherever_the_command_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = (ROOT / "configs" / "moshi-tiny.toml").resolve()
    assert presets.resolve("moshi-tiny").resolve() == tiny
    assert presets.resolve("moshi-tiny.toml").resolve() == tiny


def test_a_path_still_works_and_a_file_of_yours_wins_over_a_preset(tmp_path, monkeypatch):
    assert presets.resolve(str(ROOT / "configs" / "moshiko.toml")) == ROOT / "configs" / "moshiko.toml"
    monkeypatch.chdir(tmp_path)
    Path("moshi-tiny").write_text('[backend]\nname = "synthetic"\n')
    assert presets.resolve("moshi-tiny") == Path("moshi-tiny")
    assert load_config(presets.resolve("moshi-tiny")).backend.name == "synthetic"


def test_no_value_or_an_empty_one_means_the_defaults():
    assert presets.resolve(None) is None and presets.resolve("") is None


def test_an_unknown_name_or_a_missing_file_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="neither a file nor a preset.*moshi-tiny"):
        presets.resolve("moshi-huge")
    with pytest.raises(ConfigError, match="my.toml does not exist$"):
        presets.resolve("my.toml")
    # The checkout path the docs used to give, run where there is no checkout: the name is named.
    with pytest.raises(ConfigError, match="configs/moshiko.toml does not exist; .* --config moshiko"):
        presets.resolve("configs/moshiko.toml")


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_is_a_valid_config(name):
    load_config(presets.resolve(name))


def test_configs_lists_each_preset_on_one_line_with_what_it_is():
    result = runner.invoke(app, ["configs"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == presets.names()
    tiny = next(line for line in lines if line.startswith("moshi-tiny "))
    assert "tiny Moshi" in tiny and "CPU" in tiny


def test_configs_show_prints_the_preset_as_it_is():
    result = runner.invoke(app, ["configs", "show", "default"])
    assert result.exit_code == 0
    assert result.output == (ROOT / "configs" / "default.toml").read_text()
    refused = runner.invoke(app, ["configs", "show", "nope"])
    assert refused.exit_code == 2 and "no preset named 'nope'" in refused.output


def test_serve_takes_a_preset_name_from_the_option_and_the_environment():
    # A port already taken: serve gets as far as listening, so the config was loaded.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        by_option = runner.invoke(app, ["serve", "--port", port, "--config", "synthetic"])
        by_env = runner.invoke(app, ["serve", "--port", port], env={"DUPLEXRT_CONFIG": "synthetic"})
    assert by_option.exit_code == by_env.exit_code == 2
    assert "cannot listen" in by_option.output and "cannot listen" in by_env.output
    unknown = runner.invoke(app, ["serve", "--config", "moshi-huge"])
    assert unknown.exit_code == 2 and "neither a file nor a preset" in unknown.output


def test_simulate_takes_a_preset_name(tmp_path):
    report = tmp_path / "report.json"
    result = runner.invoke(app, ["simulate", "--config", "synthetic", "--concurrency", "2", "--frames", "4",
                                 "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["settings"]["config"]["backend"]["name"] == "synthetic"


def test_version_is_written_once_and_printed():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "duplexrt.__version__"}
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"duplexrt {duplexrt.__version__}\n"


def test_the_licence_file_matches_the_metadata():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert pyproject["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_every_moshi_preset_slides_past_its_ring_and_ending_is_an_explicit_choice_with_a_cap():
    """A dialogue does not hang up at four minutes (Kyutai's and NVIDIA's servers slide on): every
    preset of the moshi backend sets beyond_context = "slide" itself, and where a preset ends calls
    instead it also caps them.  PersonaPlex's says that sliding forgets the persona prompt too."""
    found = []
    for name in presets.names():
        config = load_config(presets.resolve(name))
        if config.backend.name != "moshi":
            continue
        options = config.backend.options
        found.append(name)
        assert options.get("beyond_context") in ("slide", "end"), f"{name}: beyond_context is not chosen"
        if options["beyond_context"] == "end":
            assert options.get("context_seconds") or config.runtime.max_session_seconds, name
    assert {"moshiko", "moshi-7b-random", "personaplex"} <= set(found)
    for name in ("moshiko", "moshi-7b-random", "personaplex"):
        assert load_config(presets.resolve(name)).backend.options["beyond_context"] == "slide", name
    text = (ROOT / "configs" / "personaplex.toml").read_text()
    assert "forgets its role prompt" in text
