"""One `Settings` definition behind the CLI flags, the SPECMESH_* variables, `--config FILE` and
docs/configuration.md: every generated flag sets its field, a mistyped name anywhere is an error
naming the nearest valid one, precedence is flags > environment > file > defaults, and the
committed reference is what the generator prints. Fast: no model, one subprocess."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml

from specmesh_services.common.config import (Settings, SettingsError, check_environment,
                                             check_keys, env_name, load_settings, setting_fields)
from specmesh_services.launch import cli
from specmesh_services.launch.flags import (COMMANDS, DEST_PREFIX, FIELDS, reference_markdown,
                                            value_type)

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"
# positional arguments each command needs before its flags
ARGV = {"run": ["run", "hi"], "up": ["up"], "serve": ["serve", "router"],
        "datastore": ["datastore", "info"], "models": ["models", "list"], "down": ["down"],
        "heads": ["heads", "extract"],
        "config show": ["config", "show"]}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No SPECMESH_* variable of the machine running the tests leaks in."""
    for key in list(os.environ):
        if key.upper().startswith("SPECMESH_"):
            monkeypatch.delenv(key)


def subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    for word in command.split():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def settings_flags(command: str) -> list[argparse.Action]:
    return [a for a in subparser(command)._actions if a.dest.startswith(DEST_PREFIX)]


def get(settings: Settings, key: str):
    value = settings
    for part in key.split("."):
        value = getattr(value, part)
    return value


def sample(action: argparse.Action, key: str) -> tuple[list[str], object]:
    """Command-line words that set `key` to a value other than its default, and that value."""
    field = FIELDS[key]
    kind, _ = value_type(field)
    default = field.get_default(call_default_factory=True)
    option = action.option_strings[0]
    if kind is bool:
        return [option], True
    if typing.get_origin(kind) is Literal:
        choice = next(c for c in typing.get_args(kind) if c != default)
        return [option, choice], choice
    if typing.get_origin(kind) is list:
        return [option, "layers:2", option, "layers:3@int8"], ["layers:2", "layers:3@int8"]
    if kind is int:
        value = (default or 0) + 1
    elif key == "device":  # a str with a pattern
        value = "cuda:1"
    else:
        value = {float: 0.25, str: "example:1234", Path: Path("/tmp/specmesh-example")}[kind]
    return [option, str(value)], value



@pytest.mark.parametrize("command", COMMANDS)
def test_every_generated_flag_sets_its_field(command):
    actions = settings_flags(command)
    assert actions, command
    for action in actions:
        key = action.dest.removeprefix(DEST_PREFIX)
        words, expected = sample(action, key)
        settings = cli.settings_from(cli.build_parser().parse_args([*ARGV[command], *words]))
        assert get(settings, key) == expected, (command, words)
    unset = cli.settings_from(cli.build_parser().parse_args(ARGV[command]))
    assert unset == Settings(), "a flag that was not given changed a setting"


def test_the_flags_users_know_keep_their_names():
    model = {"--model", "--dtype", "--draft", "--draft-vocab", "--depth", "--width",
             "--min-probability", "--speculate", "--max-nodes", "--tree-size", "--select",
             "--vote", "--cache-dir", "--datastore-path", "--batch-size", "--max-batch-tokens",
             "--kv-budget-tokens", "--attention", "--log-level",
             "--otlp-endpoint", "--trace-console"}
    # every served process's metrics (`specmesh up` gives each child a port of its own)
    service = {"--host", "--port", "--metrics-port", "--redis-url", "--router-address",
               "--drafter-address", "--datastore-address"}
    expected = {"run": model, "up": model | {"--redis-url"}, "serve": model | service,
                "datastore": model, "models": {"--cache-dir"}, "down": {"--cache-dir"}}
    for command, names in expected.items():
        given = {o for a in settings_flags(command) for o in a.option_strings}
        assert names <= given, (command, names - given)
        assert "--config" in {o for a in subparser(command)._actions for o in a.option_strings}
    # `up --port` stays the gateway's port, not a setting
    assert cli.build_parser().parse_args(["up", "--port", "6000"]).port == 6000


def test_flag_help_comes_from_the_field():
    depth = next(a for a in settings_flags("run") if a.dest == DEST_PREFIX + "speculation.depth")
    assert FIELDS["speculation.depth"].description in depth.help and "[default: 8]" in depth.help
    select = next(a for a in settings_flags("run") if "--select" in a.option_strings)
    assert select.choices == ["fixed", "lbss", "greedy", "epsilon-greedy"]


# ---------------------------------------------------------------------------------------------
# mistyped names


@pytest.mark.parametrize("variable, nearest", [
    ("SPECMESH_SPECULATION__DEPHT", "SPECMESH_SPECULATION__DEPTH"),
    ("SPECMESH_MODLE", "SPECMESH_MODEL"),
    ("SPECMESH_DEPTH", "SPECMESH_SPECULATION__DEPTH"),
    ("SPECMESH_VERIFER__BATCH_SIZE", "SPECMESH_VERIFIER__BATCH_SIZE"),
])
def test_a_mistyped_variable_names_the_nearest(monkeypatch, variable, nearest):
    monkeypatch.setenv(variable, "3")
    message = f"unknown setting {variable}: did you mean {nearest}?"
    for build in (load_settings, Settings):
        with pytest.raises(SettingsError) as err:
            build()
        assert str(err.value) == message


def test_every_setting_variable_is_accepted():
    environ = {env_name(key): "x" for key, _ in setting_fields()}
    environ.update(SPECMESH_SPECULATION="{}", specmesh_model="x", PATH="/bin")
    check_environment(environ)


def test_a_variable_typo_stops_the_command_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv("SPECMESH_SPECULATION__DEPHT", "3")
    assert cli.main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert err == ("specmesh: error: unknown setting SPECMESH_SPECULATION__DEPHT: did you mean "
                   "SPECMESH_SPECULATION__DEPTH?\n")


def test_a_variable_typo_fails_the_installed_command_without_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SPECMESH_")}
    env["SPECMESH_VERIFIER__BATCH_SIZ"] = "4"
    out = subprocess.run([sys.executable, "-m", "specmesh_services.launch.cli", "config",
                          "show"], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "specmesh: error: unknown setting SPECMESH_VERIFIER__BATCH_SIZ: did you mean "
        "SPECMESH_VERIFIER__BATCH_SIZE?"]


def config_error(tmp_path, text: str) -> tuple[object, str]:
    """The SettingsError message of loading `text` as a --config file (and the file's path)."""
    path = tmp_path / "specmesh.yaml"
    path.write_text(text)
    with pytest.raises(SettingsError) as err:
        load_settings(config_file=path)
    return path, str(err.value)


@pytest.mark.parametrize("text, message", [
    ("speculation:\n  depht: 3\n", "unknown setting speculation.depht: did you mean "
                                   "speculation.depth?"),
    ("modle: x\n", "unknown setting modle: did you mean model?"),
    ("speculaton:\n  depth: 3\n", "unknown setting speculaton: did you mean speculation?"),
    ("depth: 3\n", "unknown setting depth: did you mean speculation.depth?"),
])
def test_a_mistyped_config_key_names_the_nearest(tmp_path, text, message):
    path, error = config_error(tmp_path, text)
    assert error == f"{path}: {message}"


@pytest.mark.parametrize("text, message", [
    ("- depth\n", "expected a mapping of settings, got list"),
    ("speculation: [\n", "not valid YAML"),
    ("speculation:\n  depth: deep\n", "invalid setting speculation.depth"),
])
def test_a_bad_config_file_is_one_line(tmp_path, text, message):
    _, error = config_error(tmp_path, text)
    assert message in error and "\n" not in error
    with pytest.raises(SettingsError, match="cannot read config file"):
        load_settings(config_file=tmp_path / "missing.yaml")


def test_dicts_with_unknown_keys_are_refused_with_the_nearest():
    with pytest.raises(SettingsError, match="speculation.widht: did you mean speculation.width"):
        Settings().with_overrides(**{"speculation.widht": 2})
    with pytest.raises(SettingsError, match="verifier.batch: did you mean verifier.batch_size"):
        Settings().with_overrides(verifier={"batch": 2})
    with pytest.raises(ValueError, match="modle"):
        Settings(modle="x")
    with pytest.raises(SettingsError, match="drafter: did you mean drafters"):
        check_keys({"drafter": []})


def test_a_draft_bucket_too_small_for_a_tree_level_is_refused():
    assert Settings(draft_graph_rows=0).draft_graph_rows == 0
    assert Settings(draft_graph_rows=64).draft_graph_rows == 64
    with pytest.raises(ValueError, match="at least 64"):
        Settings(draft_graph_rows=32)


def test_dotted_keys_are_checked_against_the_settings():
    check_keys({"speculation.width": 2, "drafters": ["layers:8"], "dtype": "float32"})
    for bad in ({"speculation.widht": 2}, {"speculaton.width": 2}, {"drafter": []}):
        with pytest.raises(ValueError, match="unknown setting"):
            check_keys(bad)


def test_with_overrides_merges_a_section_key_by_key():
    settings = Settings().with_overrides(**{"speculation.depth": 3}).with_overrides(
        speculation={"width": 2})
    assert (settings.speculation.depth, settings.speculation.width) == (3, 2)


# ---------------------------------------------------------------------------------------------
# precedence, show, reference


def test_flags_over_environment_over_file_over_defaults(tmp_path, monkeypatch):
    path = tmp_path / "specmesh.yaml"
    path.write_text(yaml.safe_dump({"model": "from-file", "speculation": {
        "depth": 3, "width": 2, "max_nodes": 5, "voting": True}, "verifier": {"batch_size": 4}}))
    monkeypatch.setenv("SPECMESH_SPECULATION__DEPTH", "5")
    monkeypatch.setenv("SPECMESH_SPECULATION__WIDTH", "3")
    args = cli.build_parser().parse_args(["serve", "router", "--config", str(path),
                                          "--depth", "6", "--no-vote"])
    settings = cli.settings_from(args)
    assert settings.speculation.depth == 6  # flag over environment and file
    assert settings.speculation.width == 3  # environment over file
    assert settings.speculation.max_nodes == 5 and settings.verifier.batch_size == 4  # file
    assert settings.model == "from-file" and settings.speculation.voting is False
    assert settings.speculation.min_probability == 0.6  # default


def test_config_show_prints_a_file_config_reads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECMESH_VERIFIER__BATCH_SIZE", "3")
    assert cli.main(["config", "show", "--depth", "5", "--draft", "layers:4"]) == 0
    shown = capsys.readouterr().out
    path = tmp_path / "shown.yaml"
    path.write_text(shown)
    monkeypatch.delenv("SPECMESH_VERIFIER__BATCH_SIZE")
    settings = load_settings(config_file=path)
    assert (settings.speculation.depth, settings.verifier.batch_size, settings.drafters) == \
        (5, 3, ["layers:4"])
    assert settings == cli.settings_from(cli.build_parser().parse_args(
        ["config", "show", "--depth", "5", "--draft", "layers:4", "--batch-size", "3"]))


def test_the_configuration_reference_is_current():
    expected = reference_markdown()
    assert REFERENCE.is_file() and REFERENCE.read_text() == expected, (
        "docs/configuration.md is stale; regenerate it with "
        "`.venv/bin/python -m specmesh_services.launch.cli config reference "
        "> docs/configuration.md`")


def test_the_reference_lists_every_setting():
    text = reference_markdown()
    for key, field in setting_fields():
        assert f"| `{key}` | `{env_name(key)}` |" in text, key


def test_the_environment_up_gives_its_children_rebuilds_the_same_settings(monkeypatch):
    from specmesh_services.launch.stack import settings_env

    settings = Settings().with_overrides(drafters=["layers:4", "layers:2@int8"], redis_url="r:1",
                                         **{"speculation.depth": 3, "datastore.path": "/d"})
    for key, value in settings_env(settings).items():
        monkeypatch.setenv(key, value)
    assert load_settings() == settings == Settings()
