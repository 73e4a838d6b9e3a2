"""The `Settings` as CLI flags and as the configuration reference (docs/configuration.md).

Flags are generated from the Settings fields: type, choices (Literal), help (the field's
description) and the default shown all come from the field, so a flag cannot drift from its
setting. The tables below only say which fields get a flag on which command, under what name
where it is not `--<field>`, and how `--help` groups them.
"""
from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic.fields import FieldInfo

from specmesh_services.common.config import (Settings, env_name, load_settings, section_of,
                                             setting_fields)

DEST_PREFIX = "setting."  # argparse dest of a settings flag: "setting.speculation.depth"


class Flag(NamedTuple):
    key: str  # dotted Settings key
    name: str = ""  # option name; "" = --<field name with dashes>
    metavar: str = ""  # "" = the field name in capitals


GROUPS: dict[str, tuple[str, tuple[Flag, ...]]] = {
    "service": ("service (where it listens, whom it calls)", (
        Flag("host"), Flag("port"), Flag("metrics_port", metavar="PORT"), Flag("redis_url", metavar="URL"),
        Flag("router_address", metavar="HOST:PORT"), Flag("drafter_address", metavar="HOST:PORT"),
        Flag("datastore_address", metavar="HOST:PORT"))),
    "pool": ("pool", (Flag("redis_url", metavar="URL"),)),
    "model": ("model and speculation", (
        Flag("model"), Flag("device", metavar="auto|cpu|cuda[:N]"), Flag("dtype"),
        Flag("target_weights"), Flag("linear"), Flag("decoder_ops"), Flag("target_runner"),
        Flag("draft_runner"), Flag("draft_graph_rows", metavar="N"),
        Flag("drafters", "--draft", "SPEC"), Flag("draft_vocab", metavar="N"),
        Flag("speculation.depth", metavar="N"), Flag("speculation.width", metavar="N"),
        Flag("speculation.plain_tokens", metavar="N"),
        Flag("speculation.plain_run_seconds", metavar="S"),
        Flag("speculation.min_probability", metavar="P"),
        Flag("speculation.source", "--speculate"), Flag("speculation.max_nodes", metavar="N"),
        Flag("speculation.tree_size"), Flag("speculation.selection", "--select"),
        Flag("speculation.voting", "--vote"), Flag("cache_dir", metavar="DIR"))),
    "files": ("files", (Flag("cache_dir", metavar="DIR"),)),
    "target": ("target model", (Flag("model"), Flag("dtype"), Flag("cache_dir", metavar="DIR"))),
    "datastore": ("datastore", (Flag("datastore.path", "--datastore-path", "DIR"),)),
    "verifier": ("verifier (continuous batching, KV memory)", (
        Flag("verifier.batch_size", metavar="N"), Flag("verifier.max_batch_tokens", metavar="N"),
        Flag("verifier.kv_budget_tokens", metavar="N"), Flag("verifier.attention"),
        Flag("verifier.exact", "--exact"), Flag("verifier.prune", metavar="off|on|DIR"),
        Flag("verifier.prune_top_k", "--prune-top-k", metavar="K"),
        Flag("verifier.prune_layer", "--prune-layer", metavar="N"))),
    "gateway": ("gateway (HTTP API)", (Flag("gateway.http_port", "--http-port", "PORT"),)),
    "security": ("security (TLS between services, the gateway's API keys)", (
        Flag("tls.cert_file", "--tls-cert", "FILE"), Flag("tls.key_file", "--tls-key", "FILE"),
        Flag("tls.ca_file", "--tls-ca", "FILE"), Flag("tls.mutual", "--tls-mutual"),
        Flag("gateway.api_keys_file", "--api-keys-file", "FILE"))),
    "placement": ("placement (CPU cores of the verifier and the drafters)", (
        Flag("cores"), Flag("drafter_cores", metavar="N"))),
    "operations": ("operations", (
        Flag("log_level", metavar="LEVEL"), Flag("telemetry.otlp_endpoint", metavar="HOST:PORT"),
        Flag("telemetry.console", "--trace-console"))),
}

# which flag groups each command takes (every one of them also takes --config FILE)
COMMANDS: dict[str, tuple[str, ...]] = {
    "run": ("model", "datastore", "verifier", "placement", "operations"),
    "up": ("pool", "gateway", "model", "datastore", "verifier", "placement", "operations"),
    "serve": ("service", "gateway", "security", "model", "datastore", "verifier", "placement",
              "operations"),
    "datastore": ("model", "datastore", "verifier", "operations"),
    "heads": ("target",),
    "models": ("files",),
    "down": ("files",),
    "config show": ("service", "gateway", "security", "model", "datastore", "verifier",
                    "placement", "operations"),
}

FIELDS: dict[str, FieldInfo] = dict(setting_fields())


# ---------------------------------------------------------------------------------------------
# a field, described


def option_name(flag: Flag) -> str:
    return flag.name or "--" + flag.key.rpartition(".")[2].replace("_", "-")


def value_type(field: FieldInfo) -> tuple[Any, bool]:
    """The annotation without its `| None`, and whether None is allowed."""
    kind = field.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(kind))
    return kind, False


def type_text(field: FieldInfo) -> str:
    """`int`, `path`, `auto` \\| `torch`, `list of str`, with `(optional)` where None is valid."""
    kind, optional = value_type(field)
    if typing.get_origin(kind) is Literal:
        text = " \\| ".join(f"`{choice}`" for choice in typing.get_args(kind))
    elif typing.get_origin(kind) is list:
        text = f"list of {typing.get_args(kind)[0].__name__} (as a variable: comma-separated or JSON)"
    else:
        text = "path" if kind is Path else kind.__name__
    return text + (" (optional)" if optional else "")


def default_text(field: FieldInfo) -> str:
    """The default as a user would write it; the home directory as `~` so the text is portable."""
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, Path):
        home = str(Path.home())
        return "~" + str(value)[len(home):] if str(value).startswith(home) else str(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value) or "empty"
    return str(value) if value != "" else '""'


# ---------------------------------------------------------------------------------------------
# flags


def add_flag(group: argparse._ArgumentGroup, flag: Flag) -> None:
    """One settings flag: argparse type, choices and help taken from the field."""
    field = FIELDS[flag.key]
    kind, _ = value_type(field)
    text = (field.description or "").replace("%", "%%")
    if typing.get_origin(kind) is list:
        text += "; repeatable"
    if field.get_default(call_default_factory=True) is not None:
        text += f" [default: {default_text(field)}]"
    spec: dict[str, Any] = {"dest": DEST_PREFIX + flag.key, "default": None, "help": text}
    if kind is bool:
        spec["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is Literal:
        spec["choices"] = list(typing.get_args(kind))
    elif typing.get_origin(kind) is list:
        spec.update(action="append", metavar=flag.metavar or "VALUE")
    else:
        spec.update(type=kind, metavar=flag.metavar or flag.key.rpartition(".")[2].upper())
    group.add_argument(option_name(flag), **spec)


def add_setting_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """`--config FILE` and the settings flag groups `command` takes (COMMANDS)."""
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="YAML settings file, nested sections as mappings (docs/"
                             "configuration.md); flags and SPECMESH_* variables override it")
    for name in COMMANDS[command]:
        title, flags = GROUPS[name]
        group = parser.add_argument_group(title)
        for flag in flags:
            add_flag(group, flag)


def settings_from(args: argparse.Namespace) -> Settings:
    """The flags that were given over the environment over --config FILE over the defaults."""
    flags = {dest.removeprefix(DEST_PREFIX): value for dest, value in vars(args).items()
             if dest.startswith(DEST_PREFIX)}
    return load_settings(flags, getattr(args, "config", None))


# ---------------------------------------------------------------------------------------------
# the reference


def flag_names() -> dict[str, str]:
    """Dotted key -> its option name, over every command's groups."""
    return {flag.key: option_name(flag) for _, flags in GROUPS.values() for flag in flags}


def _default_cell(field: FieldInfo) -> str:
    """The default as code, or the words `unset` / `empty` as plain text."""
    value = field.get_default(call_default_factory=True)
    return default_text(field) if value is None or value == [] else f"`{default_text(field)}`"


def _row(key: str, field: FieldInfo, flags: dict[str, str]) -> str:
    flag = flags.get(key)
    if flag and value_type(field)[0] is bool:
        flag = f"{flag}, --no-{flag[2:]}"
    cells = [f"`{key}`", f"`{env_name(key)}`", f"`{flag}`" if flag else "",
             type_text(field), _default_cell(field),
             (field.description or "").replace("|", "\\|").replace("<", "&lt;")]
    return "| " + " | ".join(cells) + " |"


def reference_markdown() -> str:
    """docs/configuration.md: every setting with its key, variable, flag, type and default."""
    flags = flag_names()
    lines = [
        "# Configuration reference", "",
        "<!-- generated from Settings (services/common/config.py) by `specmesh config reference "
        "> docs/configuration.md`; tests/test_config.py fails when this file is stale -->", "",
        "Every setting can be given as (highest precedence first) a command-line flag where the "
        "table names one, an environment variable, or a key of a YAML file passed with "
        "`--config FILE` (sections as nested mappings); otherwise its default applies. A key or "
        "`SPECMESH_*` variable that names no setting is an error at start-up that names the "
        "nearest valid one. `specmesh config show` prints the settings in effect, as a file "
        "`--config` reads.", "",
        "```yaml", "model: smollm2-135m", "speculation:", "  depth: 6", "  tree_size: fixed",
        "verifier:", "  batch_size: 4", "```", "",
        "Settings flags by command (each also takes `--config FILE`):", ""]
    for command, groups in COMMANDS.items():
        titles = ", ".join(GROUPS[name][0] for name in groups)
        lines.append(f"- `specmesh {command}`: {titles}")
    header = ["| key | environment variable | flag | type | default | description |",
              "|---|---|---|---|---|---|"]
    lines += ["", "## Top level", "", *header]
    lines += [_row(key, field, flags) for key, field in setting_fields() if "." not in key]
    for name, field in Settings.model_fields.items():
        section = section_of(field)
        if section is None:
            continue
        lines += ["", f"## `{name}`", "", " ".join((section.__doc__ or "").split()), "",
                  f"The whole section is also one variable, `{env_name(name)}`, as JSON.", "",
                  *header]
        lines += [_row(key, leaf, flags) for key, leaf in setting_fields(section, name + ".")]
    return "\n".join(lines) + "\n"
