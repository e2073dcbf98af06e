"""Declarative settings: one table per wing, resolved as flag > environment > file > default.

Each wing lists its settings as L{Setting} rows (``relayd/<wing>/config.py``); L{relayd.tap.Options} is
built from all of them, so ``relayd --help`` documents every option in one place and every value is
validated before any socket is opened. The one setting this module owns, C{--config}, names a TOML
file of the same settings (L{CONFIG_FILE}).
"""

from __future__ import annotations

import difflib
import ipaddress
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence


class ConfigError(ValueError):
    """An invalid setting; the message names the flag or environment variable."""


@dataclass(frozen=True)
class Setting:
    """One configurable value.

    @ivar name: the long flag without dashes (``aep-buffer`` is ``--aep-buffer``); also the key in the
        resolved settings mapping.
    @ivar parse: turns the text form into the value; raises C{ValueError} with a short reason.
    @ivar env: environment variable names consulted in order when the flag is absent.
    @ivar repeatable: the flag may be given several times; the value is a list.
    @ivar switch: a boolean flag taking no argument (``--no-aep``).
    @ivar secret: never echo the value (tokens, keys) in warnings or errors, nor in any log record
        (only C{secret_part} of it, when given: a Redis URL's password, not its host).
    @ivar canonical: maps a parsed value to what it means, so that a flag overriding an environment
        variable with an equivalent spelling draws no warning.
    @ivar metavar: what the value is; for a number, its unit (C{SECONDS}, C{MS}, C{BYTES}, C{N} for a
        count, C{PORT}), which the help text names (tests/test_help.py).
    @ivar default_help: the default as C{--help} shows it when C{default} is C{None} because the value
        is derived (C{"--aep-max-sessions"}, the port used when only C{--mcp-host} is given).
    @ivar replaced_by: this is the old name of that setting, kept working: a value given under it (flag,
        environment or file) is the new setting's unless that is given too, and either way one
        warning names the new name (C{--mcp-request-timeout} became C{--mcp-request-timeout-ms}).

    Help texts are one style (tests/test_help.py): sentence case, no closing full stop, units named;
    C{--help} appends the environment variables and C{[default: X]} (L{shown_default}).
    """

    name: str
    default: Any
    help: str
    parse: Callable[[str], Any] = str
    env: tuple[str, ...] = ()
    repeatable: bool = False
    switch: bool = False
    secret: bool = False
    metavar: str | None = None
    default_help: str | None = None
    canonical: Callable[[Any], Any] = lambda value: value  # what "the same value" means for warnings
    # The parts of a secret value that are secret, scrubbed from every log record (a URL's password,
    # or its passwords: a tuple); C{None}: the whole value.
    secret_part: Callable[[Any], str | tuple[str, ...] | None] | None = None
    replaced_by: str | None = None


def show_value(value: Any, separator: str = " ") -> str:
    """A value as an operator would type it: C{14400000}, not C{14400000.0}; a list joined."""
    if isinstance(value, (list, tuple)):
        return separator.join(show_value(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def shown_default(s: Setting) -> str | None:
    """What C{[default: X]} shows for C{s}, or C{None} when it has no default (unset, off, empty)."""
    if s.default_help is not None:
        return s.default_help
    if s.switch or s.default is None or isinstance(s.default, bool) or s.default in ("", []):
        return None
    # A repeatable flag's values are given one flag each; a list parsed from one value is comma-separated.
    return show_value(s.default, " " if s.repeatable else ",")


@dataclass
class Resolved:
    """The outcome of resolving settings: values plus the warnings to log once logging is up."""

    values: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def resolve(
    settings: Sequence[Setting],
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
) -> Resolved:
    """Resolve every setting: a flag wins over the environment, which wins over the C{--config} file,
    which wins over the default.

    @param flags: values given on the command line, as text (lists of text for repeatable settings,
        C{True} for switches); absent names were not given.
    @raise ConfigError: naming the flag, environment variable or file key whose value is invalid.
    """
    out = Resolved()
    from_file = _config_file(settings, flags, environ)
    for s in settings:
        env_name, env_value = _from_env(s, environ)
        if s.name in flags:
            raw = flags[s.name]
            origin = f"--{s.name}"
        elif env_name is not None:
            raw = [env_value] if s.repeatable else env_value
            origin = env_name
        elif s.name in from_file:
            raw, origin = from_file[s.name]
        else:
            out.values[s.name] = s.default
            out.sources[s.name] = "default"
            continue
        out.sources[s.name] = origin
        value = _parse(s, raw, origin)
        out.values[s.name] = value
        if origin != env_name and env_name is not None and not s.switch:
            warning = _override_warning(s, raw, value, env_name, env_value)
            if warning:
                out.warnings.append(warning)
    for s in settings:
        if s.replaced_by is not None and out.sources.get(s.name, "default") != "default":
            _take_old_name(out, s, s.replaced_by)
    return out


def _take_old_name(out: Resolved, old: Setting, new: str) -> None:
    """A value given under a setting's old name: the new setting's, unless that is given too."""
    origin = out.sources[old.name]
    if out.sources.get(new, "default") == "default":
        out.values[new] = out.values[old.name]
        out.sources[new] = origin
        out.warnings.append(f"{origin} is deprecated: use --{new} (the same value and unit); it will be removed")
    else:
        out.warnings.append(
            f"{origin} is deprecated and ignored: --{new} is given ({out.sources[new]}); remove the old name"
        )


CONFIG_FILE = Setting(
    "config",
    None,
    "A TOML file of settings: each key an option name without its leading dashes, a list for a "
    "repeatable option, true or false for a switch; a flag or environment variable wins over it",
    env=("RELAYD_CONFIG",),
    metavar="FILE",
)
SETTINGS = [CONFIG_FILE]


def _config_file(settings: Sequence[Setting], flags: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """The C{--config} file's values as raw text with their origin (C{FILE: key}), or nothing.

    @raise ConfigError: an unreadable file, TOML it cannot parse, an unknown key (with the closest
        option named) or a value of a type no option takes.
    """
    if not any(s.name == CONFIG_FILE.name for s in settings):
        return {}
    env_name, env_value = _from_env(CONFIG_FILE, environ)
    path = flags.get(CONFIG_FILE.name, env_value if env_name is not None else None)
    if path is None:
        return {}
    where = f"--{CONFIG_FILE.name}" if CONFIG_FILE.name in flags else str(env_name)
    _refuse_undecodable(path, where)
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{where}: {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    known = {s.name: s for s in settings if s.name != CONFIG_FILE.name}
    values: dict[str, tuple[Any, str]] = {}
    for key, value in table.items():
        origin = f"{path}: {key}"
        s = known.get(key)
        if s is None:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else " (`relayd --help` lists every option)"
            raise ConfigError(f"{origin}: unknown setting{hint}")
        values[key] = (_file_value(s, value, origin), origin)
    return values


def _file_value(s: Setting, value: Any, origin: str) -> Any:
    """A TOML value as the text a flag would carry (a list for a repeatable option)."""

    def text(item: Any) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, (str, int, float)):
            return str(item)
        raise ConfigError(f"{origin}: expected a string, number or boolean, got {type(item).__name__}")

    if isinstance(value, list):
        if not s.repeatable:
            raise ConfigError(f"{origin}: takes one value, not a list")
        return [text(item) for item in value]
    if s.switch and not isinstance(value, bool):
        raise ConfigError(f"{origin}: expected true or false, got {value!r}")
    return [text(value)] if s.repeatable else text(value)


def _parse(s: Setting, raw: Any, origin: str) -> Any:
    _refuse_undecodable(raw, origin)
    if s.switch:
        return _parse_switch(raw, origin)
    try:
        if s.repeatable:
            return [s.parse(item) for item in raw]
        return s.parse(raw)
    except ValueError as e:
        shown = "" if s.secret else f" {raw!r}"
        raise ConfigError(f"{origin}:{shown} {e}") from None


def _refuse_undecodable(raw: Any, origin: str) -> None:
    """Refuse a value that is not UTF-8 text: Python hands undecodable argv and environment bytes
    over as lone surrogates, which would only fail later, with a traceback, where a wing encodes it."""
    for item in raw if isinstance(raw, list) else [raw]:
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError(f"{origin}: must be UTF-8 text (the value holds bytes that are not)") from None


def _override_warning(s: Setting, raw: Any, value: Any, env_name: str, env_value: str) -> str | None:
    """The warning for a flag that overrides a set environment variable with another value."""
    try:
        env_parsed = _parse(s, [env_value] if s.repeatable else env_value, env_name)
        if s.canonical(env_parsed) == s.canonical(value):
            return None  # the same setting, spelled differently: nothing is ignored
    except ConfigError:
        pass
    if s.secret:
        return f"{env_name} is ignored: --{s.name} was passed, and a flag wins over its env var."
    given = ",".join(raw) if isinstance(raw, list) else str(raw)
    return f"{env_name}={env_value} is ignored: --{s.name} {given} was passed, and a flag wins over its env var."


def _from_env(s: Setting, environ: Mapping[str, str]) -> tuple[str | None, str]:
    for name in s.env:
        value = environ.get(name, "")
        if value != "":  # an empty variable counts as unset
            return name, value
    return None, ""


def _parse_switch(raw: Any, origin: str) -> bool:
    if raw is True:
        return True
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{origin}: expected a boolean (1/0, true/false), got {raw!r}")


# Parsers shared by the wings' tables -------------------------------------------------------------


def integer_at_least(text: str, minimum: int, too_small: str, not_integer: str = "must be an integer") -> int:
    """An integer >= C{minimum}; the C{ValueError} otherwise says C{not_integer} or C{too_small}.

    The one integer parser of relayd's settings and of the relayd-admin options (relayd/cli/__init__.py):
    each words its refusals as its own users have always read them.
    """
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise ValueError(not_integer) from None
    if value < minimum:
        raise ValueError(too_small)
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return integer_at_least(text, 1, "must be a positive integer")


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return integer_at_least(text, 0, "must be a non-negative integer")


def non_empty(text: str) -> str:
    """Any text with at least one non-blank character."""
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def endpoint(text: str) -> str:
    """A server endpoint description (strports); checked for syntax without listening."""
    from twisted.internet import endpoints

    from relayd.base.reactor import installed

    try:
        endpoints.serverFromString(installed(), text)
    except IndexError:
        # systemd:index=N names a socket that was not passed (LISTEN_FDS/LISTEN_PID unset or too few).
        raise ValueError("is not a valid server endpoint (no such inherited socket)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"is not a valid server endpoint ({e})") from None
    port = _tcp_port(text)
    if port is not None and not 0 <= port <= 65535:
        # serverFromString takes any integer; bind() would refuse it only at start, with a traceback.
        raise ValueError(f"is not a valid server endpoint (port {port} is not in 0-65535)")
    return text


def _tcp_port(description: str) -> int | None:
    """The port of a TCP-like endpoint description (positional or C{port=}), if it names one."""
    parts = _split_strport(description)
    if not parts or parts[0] not in ("tcp", "tcp6", "ssl", "tls"):
        return None
    for i, part in enumerate(parts[1:]):
        name, eq, value = part.partition("=")
        text = value if eq and name == "port" else (part if not eq and i == 0 else None)
        if text is not None:
            try:
                return int(text)
            except ValueError:
                return None
    return None


def endpoint_interface(description: str) -> str | None:
    """The interface a TCP-like endpoint description binds, or C{None} for "all interfaces"."""
    parts = _split_strport(description)
    for part in parts[1:]:
        if part.startswith("interface="):
            return part[len("interface=") :].replace("\\:", ":")
    kind = parts[0] if parts else ""
    if kind in ("unix", "systemd"):
        return "127.0.0.1"  # not reachable from the network by itself
    return None


def is_loopback_endpoint(description: str) -> bool:
    """Whether an endpoint description listens only on loopback (or a local socket)."""
    interface = endpoint_interface(description)
    if interface is None:
        return False
    if interface in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(interface).is_loopback
    except ValueError:
        return False


def is_tls_endpoint(description: str) -> bool:
    """Whether an endpoint description terminates TLS itself."""
    kind = _split_strport(description)[0]
    return kind in ("ssl", "tls", "le", "lets")


def _split_strport(description: str) -> list[str]:
    parts: list[str] = []
    current = ""
    escaped = False
    for ch in description:
        if escaped:
            current += "\\" + ch
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == ":":
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    if parts and parts[0] == "haproxy":
        parts = parts[1:]
    return parts
