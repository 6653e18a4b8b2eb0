"""Options from the command line and config files, into a checked ``RunConfig``.

Every option can come from the command line (``--batch-size 32``) or a config file (``--config
FILE``, JSON or TOML, keys spelled like the flags: ``batch-size`` or ``batch_size``). The command
line wins over the file, the file over the defaults (psparse/config.py). Unknown keys and bad
values are errors that name the key.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from dataclasses import fields
from pathlib import Path

from .config import HELP, RECORD_ONLY, ConfigError, RunConfig

NOT_FLAGS = ("script",)  # set by psparse-launch's positional argument, not by a flag


def add_config_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None):
    """Add ``--config`` and one flag per RunConfig field (default None = not given)."""
    parser.add_argument("--config", type=Path, default=None,
                        help="JSON or TOML file of options (keys as the flags below)")
    group = parser.add_argument_group("run configuration (also settable in --config)")
    for f in fields(RunConfig):
        if (only is not None and f.name not in only) or f.name in NOT_FLAGS:
            continue
        if f.name in ("policy_args", "model_args"):
            group.add_argument("--" + f.name[:-1].replace("_", "-"), action="append",
                               default=None, dest=f.name, metavar="KEY=VALUE",
                               help=HELP[f.name])
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f)
        if kind is bool:
            group.add_argument(flag, action="store_true", default=None, dest=f.name,
                               help=HELP[f.name])
            continue
        text = HELP[f.name] if "default" in HELP[f.name] else f"{HELP[f.name]} (default: {f.default})"
        # argparse %-formats help strings: a literal "25%" would crash --help
        group.add_argument(flag, type=kind, default=None, dest=f.name,
                           metavar=kind.__name__.upper(), help=text.replace("%", "%%"))


def _field_type(f):
    t = str(f.type)
    if "list" in t:
        return list
    if t == "bool":
        return bool
    if "int" in t and "float" not in t:
        return int
    if "float" in t:
        return float
    return str


def parse_with_config(parser: argparse.ArgumentParser, argv=None):
    """(args, config) from the command line; a bad config exits with the parser's error."""
    args = parser.parse_args(argv)
    try:
        return args, resolve_config(args)
    except ConfigError as exc:
        parser.error(str(exc))


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """Defaults, then the config file, then command-line flags; validated."""
    values = {}
    if getattr(args, "config", None) is not None:
        values.update(load_config_file(args.config))
    for f in fields(RunConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    try:
        return RunConfig(**values).validate()
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def load_config_file(path: Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid "
                          f"{'TOML' if path.suffix == '.toml' else 'JSON'}: {exc}") from None
    return config_from_map(raw, f"config file {path}")


def config_from_json(text: str, source: str) -> dict:
    """Options from a JSON text (psparse-launch's PSPARSE_CONFIG_JSON)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source} is not valid JSON: {exc}") from None
    return config_from_map(raw, source)


def config_from_map(raw, source: str) -> dict:
    """Checked RunConfig values from a map of options (keys as flags or field names)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must hold a map of options")
    known = {f.name: f for f in fields(RunConfig)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in RECORD_ONLY:  # written by psparse-launch beside the options; not options
            continue
        if name in ("policy_arg", "model_arg"):
            name += "s"
        if name in ("policy_args", "model_args") and isinstance(value, dict):
            value = [f"{k}={v}" for k, v in value.items()]  # a [policy-args] table
        if name not in known:
            raise ConfigError(f"{source}: unknown option {key!r}; valid options: "
                              f"{', '.join(n.replace('_', '-') for n in known)}")
        kind = _field_type(known[name])
        if value is not None:
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ConfigError(f"{source}: option {key!r} must be "
                                  f"{kind.__name__}, got {value!r}")
        out[name] = value
    return out
