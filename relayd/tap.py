"""The twistd plugin's Options and makeService: every wing as a child of one MultiService."""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import threading
from typing import Any, Mapping, NoReturn, Sequence

from twisted.application.service import MultiService
from twisted.internet import defer
from twisted.internet.error import ReactorNotRunning
from twisted.logger import Logger
from twisted.python import usage

import relayd
from relayd.base.clock import Timekeeper
from relayd.base.config import ConfigError, Resolved, Setting, resolve, show_value, shown_default
from relayd.base.reactor import IReactor, installed
from relayd.compat import logger as compat_logger
from relayd.compat import reactor as compat_reactor
from relayd.logs import access, access_log, output, scrub
from relayd.process import host
from relayd.process.host import CollectorPolicy, increase_rlimits
from relayd.storage.redis import Redis
from relayd.web import metrics_listener
from relayd.web.listen import CannotListen
from relayd.wing import IWing, Plumbing, browser_policy

# The wings, in start order (shutdown drains them in reverse). Each is a package with a `config`
# module (SETTINGS, its table) and a `service` module (make_wing(plumbing, settings) -> IWing or
# None): relayd/wing.py, docs/architecture.md "Adding a wing". Adding a wing is one line here.
WINGS: tuple[str, ...] = (
    "relayd.aep",
    "relayd.mcp",
    "relayd.buzz",
)


def _wing_modules(kind: str, wings: Sequence[str] = WINGS) -> list[Any]:
    """Each wing's C{config} or C{service} module (imported here, so the plugin stays cheap)."""
    return [importlib.import_module(f"{wing}.{kind}") for wing in wings]


# Settings that belong to no wing (shared plumbing).
GLOBAL_SETTINGS = ("relayd.base.config", "relayd.process.settings")


def all_settings(wings: Sequence[str] = WINGS) -> list[Setting]:
    """Every setting: the shared ones, then every wing's, in wing order."""
    settings: list[Setting] = []
    for name in GLOBAL_SETTINGS:
        settings.extend(importlib.import_module(name).SETTINGS)
    for module in _wing_modules("config", wings):
        settings.extend(module.SETTINGS)
    return settings


def _make_option_class(settings: Sequence[Setting]) -> type[usage.Options]:
    namespace: dict[str, Any] = {}
    for s in settings:
        namespace["opt_" + s.name.replace("-", "_")] = _option_method(s)
    return type("_WingOptions", (usage.Options,), namespace)


def _option_method(s: Setting) -> Any:
    """The C{opt_} method for C{s}; its docstring is the help line: help, environment, default.

    twistd prints C{[default: X]} only for C{optParameters}; these methods carry their own, shown as
    an operator would type the value (relayd.base.config.shown_default).
    """
    shown = shown_default(s)
    default = "" if shown is None else f" [default: {shown}]"
    env = f" (env {', '.join(s.env)})" if s.env else ""
    if s.switch:

        def switch(self: Options) -> None:
            self.given[s.name] = True

        switch.__doc__ = s.help + env
        return switch

    def value(self: Options, text: str) -> None:
        if s.repeatable:
            self.given.setdefault(s.name, []).append(text)
        else:
            self.given[s.name] = text

    value.__doc__ = s.help + env + default
    return value


class Options(_make_option_class(all_settings())):  # type: ignore[misc]
    """relayd's command line: every wing's flags; flag > environment > default."""

    synopsis = "[options]"
    wings: tuple[str, ...] = WINGS  # whose flags these are, and which wings makeService builds
    longdesc = (
        "relayd relays agent traffic: the AEP event relay, the MCP tunnel relay and the Buzz broker "
        "host, each on its own loopback listener by default. Every option can also be set through "
        "the environment variable named with it; a flag wins over the environment."
    )

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.environ = os.environ if environ is None else environ
        self.given: dict[str, Any] = {}
        self.settings = Resolved()
        self._refused = False
        self._check_only = False

    def parseOptions(self, options: Sequence[str] | None = None) -> None:
        try:
            super().parseOptions(options)
        except usage.UsageError:
            self._refused = True
            raise

    def getUsage(self, width: int | None = None) -> str:
        # twistd prints the usage before a parse error: after an unknown flag, one line pointing at
        # --help, not the 180-line option list (the error itself follows on the next line).
        if self._refused:
            return "Run `relayd --help` (or `twistd -n relayd --help`) for every option."
        return str(super().getUsage(width))

    def opt_help(self) -> None:
        """Display this help and exit"""
        super().opt_help()

    opt_h = opt_help  # the same method: twistd lists it as "-h, --help"

    def opt_check_config(self) -> None:
        """Check the settings (flags, environment, --config file), print those not at their default and exit"""
        self._check_only = True

    def opt_version(self) -> None:
        """Display relayd's version (and Twisted's and Python's) and exit"""
        import twisted

        sys.stdout.write(f"relayd {relayd.__version__} (Twisted {twisted.__version__}, Python {sys.version.split()[0]})\n")
        sys.stdout.flush()
        raise SystemExit(0)

    def postOptions(self) -> None:
        try:
            self.settings = resolve(all_settings(self.wings), self.given, self.environ)
            check_combinations(self.settings, self.wings)
        except ConfigError as e:
            # One line and status 2, before anything listens (twistd would print the whole usage).
            sys.stderr.write(f"relayd: error: {e}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None
        if self._check_only:
            sys.stdout.write(checked_configuration(all_settings(self.wings), self.settings))
            sys.stdout.flush()
            raise SystemExit(0)


def check_combinations(settings: Resolved, wings: Sequence[str] = WINGS) -> None:
    """What a start refuses of the settings taken together, each option being valid alone: the
    plumbing's browser policy (C{--allow-host}/C{--allow-origin}) and each wing's C{configured}, the
    very checks C{makeService} and C{make_wing} make (one copy). Opens no socket, file or connection.

    @raise ConfigError: the first refusal, in the words a start would use.
    """
    browser_policy(settings)
    for module in _wing_modules("service", wings):
        module.configured(settings)


def checked_configuration(settings: Sequence[Setting], resolved: Resolved) -> str:
    """What C{--check-config} prints: OK, then each setting not at its default and where it came from."""
    lines = ["relayd: configuration OK"]
    for s in settings:
        source = resolved.sources.get(s.name, "default")
        if source == "default":
            continue
        value = "[secret]" if s.secret else show_value(resolved[s.name])
        lines.append(f"  {s.name} = {value}  ({source})")
    if resolved.warnings:
        lines += [f"  warning: {w}" for w in resolved.warnings]
    return "\n".join(lines) + "\n"


def options_for(wings: Sequence[str]) -> type[Options]:
    """An L{Options} for another tuple of wings: their flags, and C{makeService} builds them (how
    tests/test_wing.py adds a wing with one line)."""
    flags = _make_option_class(all_settings(wings))
    return type("Options", (flags, Options), {"wings": tuple(wings)})


class RelaydService(MultiService):
    """The root service: the wings, then the shared Redis client and the clock's timers, stopped in
    that order.

    @ivar redis: the process's one Redis client (the plumbing's), or C{None}; closed here at stop.
    """

    _log = Logger()

    def __init__(
        self,
        reactor: IReactor,
        clock: Timekeeper,
        warnings: Sequence[str] = (),
        redis: Redis | None = None,
        collector: CollectorPolicy | None = None,
    ) -> None:
        super().__init__()
        self.reactor = reactor
        self.clock = clock
        self.redis = redis
        self._warnings = list(warnings)
        self.collector = collector if collector is not None else CollectorPolicy(clock, 0, 0)
        self.exit_status = 0
        self.exit = _exit_after_shutdown  # how a refusal ends the process (a test replaces it)
        self._hangup_before: Any = None

    def privilegedStartService(self) -> None:
        # twistd binds the listeners here, before startService, and Twisted logs a line per port as
        # it does: the text log leaves those out from now on (access.is_port_noise).
        access.quicken_access_lines()
        try:
            super().privilegedStartService()
        except CannotListen as e:
            # One line on the process's own stderr (twistd has put a logger in sys.stderr's place),
            # then exit 1 with no traceback (StartRefused).
            line = f"relayd: {e}"
            stderr = sys.__stderr__
            if stderr is not None:
                stderr.write(line + "\n")
                stderr.flush()
            raise StartRefused(line) from None

    def startService(self) -> None:
        for warning in self._warnings:
            self._log.warn("{warning}", warning=warning)
        self._catch_hangup()
        if self.redis is not None:
            # Redis holding another relayd keyspace version: refuse to run on it (docs/deployment.md "Upgrades").
            self.redis.refused.addCallback(self.refuse)
        # Each I/O event handled in the log context Twisted gives it, without its eight calls per event
        # (before anything hooks the reactor's poll: the log writers below do).
        compat_reactor.quick_dispatch(self.reactor)
        super().startService()
        # twistd's text log is in place by now (it starts after makeService).
        access.quicken_access_lines()
        # Once the reactor runs, a turn's log lines are written together (one write(2), not one per
        # request); the reactor has not run yet, so start-up lines went straight through.
        output.write_once_per_turn(self.reactor, self.clock)
        # ...and an access line goes straight into that writer while twistd's text log is all that
        # observes the log (checked again whenever the observers change).
        access_log.write_access_lines_directly()
        # What start-up allocated lives as long as the process: move it out of the collector's
        # view, so full collections scan only what traffic allocates (gen-2 pauses of 26-55 ms
        # under load became ~3 ms in the MCP benchmark); then, periodically, what traffic left
        # alive (relayd/process/host.py).
        self.collector.start()
        waiting = [wing.ports() for wing in self.wings()]
        defer.gatherResults(waiting, consumeErrors=True).addCallbacks(self._ready, lambda f: None)

    def _catch_hangup(self) -> None:
        """SIGHUP (a closed terminal, a reload by habit) ends a Python process by default, with no
        drain and no word: relayd logs it and keeps running (docs/deployment.md, "Signals")."""
        if threading.current_thread() is not threading.main_thread():
            return  # (only the main thread may set a handler; twistd's is it)

        def hangup(signum: int, frame: Any) -> None:
            self.reactor.callFromThread(
                self._log.warn,
                "SIGHUP received: relayd reads its settings only at start (restart it to change them), "
                "and a --logfile is rotated with SIGUSR1; it keeps running",
            )

        self._hangup_before = signal.signal(signal.SIGHUP, hangup)

    def wings(self) -> list[Any]:
        """The children that are wings (L{IWing}): the metrics listener, then the wings."""
        return [child for child in self if IWing.providedBy(child)]

    def _ready(self, ports: list[Any]) -> None:
        """Every listener is bound: tell systemd (C{Type=notify}) we are ready."""
        names = [wing.name for wing in self.wings()]
        self._log.info("relayd ready: {relays}", relays=", ".join(names))
        host.notify("READY=1\nSTATUS=listening: " + ", ".join(names))

    def refuse(self, reason: str) -> None:
        """Stop the process with exit status 1: a refusal only a connection could find, after the
        listeners started (the reason was logged, as a critical line, where it was found)."""
        if self.exit_status:
            return
        self.exit_status = 1
        self._log.critical("relayd stops (exit status {status}): it cannot run on this Redis", status=self.exit_status)
        self.exit(self.exit_status, self.reactor)

    @defer.inlineCallbacks
    def stopService(self) -> Any:
        host.notify("STOPPING=1")
        if self._hangup_before is not None:
            signal.signal(signal.SIGHUP, self._hangup_before)
            self._hangup_before = None
        yield super().stopService()
        # The wings are drained; now the shared Redis client (if any) can go.
        if self.redis is not None:
            yield self.redis.close()
        self.clock.shutdown()
        if all(wing.drained for wing in self.wings()):
            # Drained cleanly: exit 0. twistd would otherwise re-raise the SIGTERM that stopped it,
            # and an operator (or a supervisor) could not tell a clean drain from an abort.
            compat_logger.forget_exit_signal(self.reactor)


class StartRefused(SystemExit, Exception):
    """The exit of a start that cannot go on (a port that cannot be bound), its reason already told.

    A C{SystemExit}, so the interpreter ends with its status and prints no traceback; an
    C{Exception} too, so that twistd, which handles an C{Exception} of its start-up (not a
    C{SystemExit}), removes its pid file and reports it through a daemon's status pipe first.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.code = 1  # the exit status (the reason is what a daemon's status pipe carries)


def _exit_after_shutdown(status: int, reactor: IReactor) -> None:
    """Stop the reactor (the services drain as on SIGTERM), then end the process with C{status}.

    twistd always exits 0 once its reactor has stopped and has no exit status of its own to set:
    the status is applied at interpreter exit, after twistd has removed its pid file and closed
    its log.
    """

    def exit_now() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    atexit.register(exit_now)
    try:
        reactor.stop()
    except ReactorNotRunning:  # already stopping (a signal came first)
        pass


def makeService(config: Options, reactor: IReactor | None = None) -> RelaydService:
    """Build the relayd service tree from parsed options: the plumbing once, then every wing on it."""
    if reactor is None:
        reactor = installed()
    settings = config.settings
    # Before anything is logged: no observer (twistd's text log, --logger, twist's JSON) sees a secret.
    scrub.install_scrubber()
    for s in all_settings(config.wings):
        if s.secret and isinstance(settings.values.get(s.name), str):
            value = settings[s.name]
            part = s.secret_part(value) if s.secret_part else value
            for secret in part if isinstance(part, tuple) else (part,):
                scrub.register_secret(secret)
    increase_rlimits()
    try:
        plumbing = Plumbing.from_settings(settings, reactor, Timekeeper(reactor))
    except ConfigError as e:  # (the browser policy: checked at option time too, check_combinations)
        _refuse_start(e)
    collector = CollectorPolicy(plumbing.clock, settings["gc-freeze-interval"], settings["gc-full-interval"])
    root = RelaydService(reactor, plumbing.clock, settings.warnings, redis=plumbing.redis, collector=collector)
    try:
        if settings.values.get("metrics-listen"):
            metrics_listener.make_service(
                settings["metrics-listen"], reactor, plumbing.clock, site=plumbing.site, grace=plumbing.grace
            ).setServiceParent(root)
        for module in _wing_modules("service", config.wings):
            wing = module.make_wing(plumbing, settings)
            if wing is not None:
                wing.setServiceParent(root)
    except ConfigError as e:
        _refuse_start(e)
    return root


def _refuse_start(error: ConfigError) -> NoReturn:
    """One line and exit status 2, before anything listens."""
    sys.stderr.write(f"relayd: error: {error}\n")
    sys.stderr.flush()
    raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> None:
    """The C{relayd} command: C{twistd -n --pidfile= relayd ARGS}, in the foreground with no pid file.

    The options are checked here first so a mistake is one line and status 1 (twistd would name
    itself in the error); C{--help}, C{--version} and C{--check-config} (or C{relayd check-config
    [FILE]}) exit here too.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["check-config"]:
        # `relayd check-config [FILE] [options]`: the same as `relayd --check-config [--config FILE]`.
        rest = args[1:]
        file = ["--config", rest.pop(0)] if rest and not rest[0].startswith("-") else []
        args = ["--check-config", *file, *rest]
    options = Options()
    options.synopsis = "Usage: relayd [options]"
    try:
        options.parseOptions(args)
    except usage.UsageError as e:
        sys.stderr.write(f"relayd: {e}\nRun `relayd --help` for every option.\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    from twisted.scripts.twistd import run

    sys.argv = ["relayd", "--nodaemon", "--pidfile=", "relayd", *args]
    run()
