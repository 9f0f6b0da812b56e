"""Settings of the long-running commands from a TOML file, ``P2PTRAIN_*`` variables and flags.

``p2ptrain peer --config run.toml`` (and ``p2ptrain swarm --config``) read their options from three
places, the first that sets an option wins:

1. flags on the command line (``--epochs 50``);
2. environment variables ``P2PTRAIN_<FLAG>`` (``P2PTRAIN_EPOCHS=50``, ``P2PTRAIN_BOOTSTRAP="/ip4/... /ip4/..."``);
3. the TOML file given by ``--config``, whose keys are the long flags
   with ``_`` for ``-`` (``target_batch_size = 512``, ``bootstrap = ["/ip4/..."]``, ``example = "digits"``);

and then the flag's default. The options and their types are the command's own argparse
options, so a new flag is configurable at once. Everything is validated before the command
starts, with a one-line :class:`dht.ConfigError` that names the field and where it came from:
unknown keys (with the closest valid one), wrong types, values outside the choices, malformed
multiaddrs, a key file that cannot be read. Relative paths in the file are relative to the file.

``--bootstrap`` and ``--bootstrap-file`` are one setting: whichever layer names either of them
decides both, so ``--bootstrap-file`` on the command line still beats ``bootstrap`` in the file.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dht import ConfigError, Identity, Multiaddr

from .background import parse_multiaddrs

ENV_PREFIX = "P2PTRAIN_"

# verbose_1, log_json_1: -v/--log-json given after a command (cli._add_logging_flags), flags only:
# logging starts before the file is read. (Only a command's own options are read from the file,
# so the dests of nested commands, verbose_2..., never reach it.)
_NOT_CONFIGURABLE = {"help", "config", "version", "verbose_1", "log_json_1"}
_GROUPS = ({"bootstrap", "bootstrap_file"},)  # keys that are one setting together
_PATH_KEYS = {"bootstrap_file", "key_file", "save", "round_log", "out", "script", "swarm_key_file", "data_dir",
              "peer_cache"}  # relative to the config file
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Option:
    """One configurable option, as its argparse action defines it."""

    key: str  # the action's dest: the TOML key, and the env var's suffix in upper case
    flag: str  # --target-batch-size
    kind: str  # int, float, str, bool or list
    choices: tuple[Any, ...] | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()


def options_of(parser: argparse.ArgumentParser) -> dict[str, Option]:
    """The configurable options of one (sub)command's parser, by key."""
    out: dict[str, Option] = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest in _NOT_CONFIGURABLE:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            kind = "bool"
        elif isinstance(action, argparse._AppendAction):
            kind = "list"
        elif isinstance(action, argparse._CountAction) or action.type is int:
            kind = "int"
        elif action.type is float:
            kind = "float"
        elif action.type in (None, str):
            kind = "str"
        else:
            continue  # a custom type: flags only
        out[action.dest] = Option(action.dest, longs[0], kind, tuple(action.choices) if action.choices else None)
    return out


# --------------------------------------------------------------------------- checking one value


def _describe(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a table"}
    return f"{names.get(type(value), type(value).__name__)} ({value!r})" if not isinstance(value, dict) \
        else "a table"


def _check(option: Option, value: Any, where: str) -> Any:
    """``value`` (from TOML) converted to what the flag would give, or a ConfigError naming ``where``."""
    kind = option.kind
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind == "str":
        ok = isinstance(value, str)
    else:  # list of strings; a single string is a list of one
        if isinstance(value, str):
            value = [value]
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    if not ok:
        expected = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
                    "list": "a list of strings"}[kind]
        raise ConfigError(f"{where}: expected {expected}, got {_describe(value)}")
    if option.choices is not None and value not in option.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, option.choices))}")
    return value


def _from_env(option: Option, text: str) -> Any:
    where = f"${option.env}"
    kind = option.kind
    if kind == "bool":
        low = text.strip().lower()
        if low not in _TRUE | _FALSE:
            raise ConfigError(f"{where}: expected true or false (1/0, yes/no), got {text!r}")
        return _check(option, low in _TRUE, where)
    if kind in ("int", "float"):
        try:
            value: Any = int(text) if kind == "int" else float(text)
        except ValueError:
            raise ConfigError(f"{where}: expected {'an integer' if kind == 'int' else 'a number'}, "
                              f"got {text!r}") from None
        return _check(option, value, where)
    if kind == "list":
        return _check(option, text.replace(",", " ").split(), where)
    return _check(option, text, where)


# --------------------------------------------------------------------------- reading the layers


def read_file(path: str | os.PathLike[str], options: Mapping[str, Option], command: str = "",
              all_keys: Sequence[str] = ()) -> dict[str, Any]:
    """The settings of a TOML config file, checked against ``options``.

    ``all_keys``: keys other commands accept (a shared run.toml may hold them); naming one gives a
    clearer error than "unknown key".
    """
    label = str(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{label}: cannot read the config file: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{label}: not valid TOML: {e}") from None
    base = Path(path).expanduser().resolve().parent
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        option = options.get(key)
        if option is None:
            if isinstance(value, dict):
                raise ConfigError(f"{label}: [{raw_key}]: tables are not used; put the keys at the top level "
                                  "(one file per command)")
            if key in all_keys:
                raise ConfigError(f"{label}: key {raw_key!r} does not apply to 'p2ptrain {command}'")
            close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(sorted(options))})"
            raise ConfigError(f"{label}: unknown key {raw_key!r}{hint}")
        value = _check(option, value, f"{label}: {raw_key}")
        if key in _PATH_KEYS and isinstance(value, str):
            value = str(base / Path(value).expanduser())
        out[key] = value
    return out


def read_env(env: Mapping[str, str], options: Mapping[str, Option]) -> dict[str, Any]:
    """Settings from ``P2PTRAIN_<KEY>`` variables (other ``P2PTRAIN_*`` variables are left alone)."""
    out: dict[str, Any] = {}
    for key, option in options.items():
        text = env.get(option.env)
        if text is not None:
            out[key] = _from_env(option, text)
    return out


def explicit_keys(make_parser: Callable[[], argparse.ArgumentParser], argv: Sequence[str]) -> set[str]:
    """The options given on the command line ``argv`` (whatever their value, even the default)."""
    parser = make_parser()
    _suppress_defaults(parser)
    return set(vars(parser.parse_args(list(argv))))


def _suppress_defaults(parser: argparse.ArgumentParser) -> None:
    parser._defaults.clear()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _suppress_defaults(sub)
        elif action.dest != "help":
            action.default = argparse.SUPPRESS


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise KeyError(command)


# --------------------------------------------------------------------------- putting it together


def apply_config(args: argparse.Namespace, make_parser: Callable[[], argparse.ArgumentParser],
                 argv: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Fill ``args`` (parsed from ``argv``) from the environment and the config file, flags first,
    then validate; returns where each setting came from (key -> "--flag", "$VAR" or the file).
    ``args.config``: the file, or None."""
    env = os.environ if env is None else env
    parser = make_parser()
    command = args.command
    options = options_of(subparser(parser, command))
    others: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                others.update(options_of(sub))
    explicit = explicit_keys(make_parser, argv)
    sources = {key: options[key].flag for key in options if key in explicit}

    path = getattr(args, "config", None)
    from_file = read_file(path, options, command, sorted(others)) if path else {}
    from_env = read_env(env, options)
    for group in _GROUPS:
        if group & explicit:
            for key in group:
                from_env.pop(key, None)
                from_file.pop(key, None)
        elif group & from_env.keys():
            for key in group:
                from_file.pop(key, None)
    for layer, name in ((from_file, str(path)), (from_env, None)):
        for key, value in layer.items():
            if key not in explicit:
                setattr(args, key, value)
                sources[key] = name if name is not None else f"${options[key].env}"
    validate(args, sources)
    return sources


def _where(key: str, sources: Mapping[str, str]) -> str:
    source = sources.get(key, "--" + key.replace("_", "-"))
    return f"{source}: {key}" if not source.startswith(("--", "$")) else source


def validate(args: argparse.Namespace, sources: Mapping[str, str]) -> None:
    """What argparse cannot check by type: multiaddrs, the listen address, the key file, ports.
    ``args.bootstrap`` is parsed here, once: it becomes a list of ``Multiaddr``."""
    if getattr(args, "bootstrap", None):
        args.bootstrap = parse_multiaddrs(args.bootstrap, _where("bootstrap", sources))
    listen = getattr(args, "listen", None)
    if listen is not None:
        try:
            parsed = Multiaddr.parse(listen)
        except ConfigError as e:
            raise ConfigError(f"{_where('listen', sources)}: {e}") from None
        if parsed.host_proto not in ("ip4", "ip6"):
            raise ConfigError(f"{_where('listen', sources)} {listen!r}: listen on an IP address (/ip4/... or "
                              "/ip6/...), not a DNS name")
        if parsed.is_circuit:
            raise ConfigError(f"{_where('listen', sources)}: a /p2p-circuit address is reached through its relay, "
                              "nobody listens on it: listen on an IP address of this machine, or run --client "
                              "--relay-via RELAY_MULTIADDR to be reachable through a relay")
    aggregation, compression = getattr(args, "aggregation", None), getattr(args, "compression", None)
    if isinstance(aggregation, str) and isinstance(compression, str):
        from .optim.options import check_options

        try:
            check_options(aggregation=aggregation, compression=compression)
        except ValueError as e:
            raise ConfigError(f"{_where('aggregation', sources)}: {e}") from None
    key_file = getattr(args, "key_file", None)
    if key_file is not None:
        check_key_file(key_file, _where("key_file", sources))
    swarm_key_file = getattr(args, "swarm_key_file", None)
    if swarm_key_file is not None:  # must exist: a private swarm's key is created once, shared by hand
        from dht import SwarmKey

        try:
            SwarmKey.load(swarm_key_file)
        except ConfigError as e:
            raise ConfigError(f"{_where('swarm_key_file', sources)}: {e}") from None
    port = getattr(args, "metrics_port", None)
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"{_where('metrics_port', sources)} must be between 0 and 65535 (0: any free port)")
    for key in ("bootstrap_file", "round_log", "save", "data_dir"):
        value = getattr(args, key, None)
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{_where(key, sources)}: empty path")


def check_key_file(path: str, where: str = "--key-file") -> None:
    """A key file that exists must be a p2ptrain key we can read; a missing one must be creatable,
    so its missing directories are created here (mode 0700: they will hold a private key). Every
    command that takes --key-file calls this before it starts."""
    p = Path(path).expanduser()
    if p.exists() or p.is_symlink():
        try:
            Identity.load(p)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        return
    parent = p.parent if str(p.parent) else Path(".")
    missing = [d for d in (parent, *parent.parents) if not d.exists()]
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(f"{where}: cannot create key file {path}: cannot create directory {d}: "
                              f"{e.strerror or e}") from None
    if not parent.is_dir():
        raise ConfigError(f"{where}: cannot create key file {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: cannot create key file {path}: directory {parent} is not writable")
