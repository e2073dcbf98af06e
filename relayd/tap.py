"""The twistd plugin's Options and makeService: every wing as a child of one MultiService."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Mapping, Sequence

from twisted.application.service import IService, MultiService
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python import usage

import relayd
from relayd import logging as relayd_logging
from relayd import metrics, sdnotify
from relayd.clock import Clock
from relayd.config import ConfigError, Resolved, Setting, resolve
from relayd.gcpolicy import CollectorPolicy
from relayd.redis import clients as redis_clients
from relayd.rlimits import increase_rlimits
from relayd.web.site import RelaySite

# Each wing provides relayd.<wing>.config.SETTINGS and relayd.<wing>.service.make_service.
WINGS = ("aep", "mcp", "buzz")


def _wing_modules(kind: str) -> list[Any]:
    """Each wing's C{config} or C{service} module (imported here, so the plugin stays cheap)."""
    return [importlib.import_module(f"relayd.{wing}.{kind}") for wing in WINGS]


# Settings that belong to no wing (shared plumbing).
GLOBAL_SETTINGS = ("relayd.settings", "relayd.redis_config")


def all_settings() -> list[Setting]:
    """Every setting: the shared ones, then every wing's, in wing order."""
    settings: list[Setting] = []
    for name in GLOBAL_SETTINGS:
        settings.extend(importlib.import_module(name).SETTINGS)
    for module in _wing_modules("config"):
        settings.extend(module.SETTINGS)
    return settings


def _make_option_class(settings: Sequence[Setting]) -> type[usage.Options]:
    namespace: dict[str, Any] = {}
    for s in settings:
        namespace["opt_" + s.name.replace("-", "_")] = _option_method(s)
    return type("_WingOptions", (usage.Options,), namespace)


def _option_method(s: Setting) -> Any:
    default = "" if s.default in (None, [], False) else f" [default: {_show(s.default)}]"
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


def _show(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


class Options(_make_option_class(all_settings())):  # type: ignore[misc]
    """relayd's command line: every wing's flags; flag > environment > default."""

    synopsis = "[options]"
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

    def opt_h(self) -> None:
        """Display this help and exit."""
        self.opt_help()

    def opt_version(self) -> None:
        """Display relayd's version (and Twisted's and Python's) and exit."""
        import twisted

        sys.stdout.write(f"relayd {relayd.__version__} (Twisted {twisted.__version__}, Python {sys.version.split()[0]})\n")
        sys.stdout.flush()
        raise SystemExit(0)

    def postOptions(self) -> None:
        try:
            self.settings = resolve(all_settings(), self.given, self.environ)
        except ConfigError as e:
            # One line and status 2, before anything listens (twistd would print the whole usage).
            sys.stderr.write(f"relayd: error: {e}\n")
            sys.stderr.flush()
            raise SystemExit(2)


class RelaydService(MultiService):
    """The root service: the wings, then the clock's timers, stopped in that order."""

    _log = Logger()

    def __init__(self, clock: Clock, warnings: Sequence[str] = (), collector: CollectorPolicy | None = None) -> None:
        super().__init__()
        self.clock = clock
        self._warnings = list(warnings)
        self.collector = collector if collector is not None else CollectorPolicy(clock, 0, 0)

    def startService(self) -> None:
        for warning in self._warnings:
            self._log.warn("{warning}", warning=warning)
        super().startService()
        # twistd's text log is in place by now (it starts after makeService).
        relayd_logging.quicken_access_lines()
        # What start-up allocated lives as long as the process: move it out of the collector's
        # view, so full collections scan only what traffic allocates (gen-2 pauses of 26-55 ms
        # under load became ~3 ms in the MCP benchmark); then, periodically, what traffic left
        # alive (relayd/gcpolicy.py).
        self.collector.start()
        waiting = [child.ports() for child in self if callable(getattr(child, "ports", None))]
        defer.gatherResults(waiting, consumeErrors=True).addCallbacks(self._ready, lambda f: None)

    def _ready(self, ports: list[Any]) -> None:
        """Every listener is bound: tell systemd (C{Type=notify}) we are ready."""
        names = [child.name for child in self if callable(getattr(child, "ports", None))]
        self._log.info("relayd ready: {relays}", relays=", ".join(names))
        sdnotify.notify("READY=1\nSTATUS=listening: " + ", ".join(names))

    @defer.inlineCallbacks
    def stopService(self) -> Any:
        sdnotify.notify("STOPPING=1")
        yield super().stopService()
        # The wings are drained; now the shared Redis connections (if any) can go.
        yield defer.gatherResults([client.close() for client in redis_clients()], consumeErrors=True)
        self.clock.shutdown()
        if all(getattr(child, "drained", True) for child in self):
            # Drained cleanly: exit 0. twistd would otherwise re-raise the SIGTERM that stopped it,
            # and an operator (or a supervisor) could not tell a clean drain from an abort.
            reactor = self.clock.reactor
            if getattr(reactor, "_exitSignal", None) is not None:
                reactor._exitSignal = None


def makeService(config: Options, reactor: Any = None) -> IService:
    """Build the relayd service tree from parsed options."""
    if reactor is None:
        from twisted.internet import reactor as _reactor

        reactor = _reactor
    settings = config.settings
    # Before anything is logged: no observer (twistd's text log, --logger, twist's JSON) sees a secret.
    relayd_logging.install_scrubber()
    for s in all_settings():
        if s.secret and isinstance(settings.values.get(s.name), str):
            relayd_logging.register_secret(settings[s.name])
    increase_rlimits()
    clock = Clock(reactor)
    collector = CollectorPolicy(clock, settings["gc-freeze-interval"], settings["gc-full-interval"])
    root = RelaydService(clock, settings.warnings, collector)
    try:
        if settings.values.get("metrics-listen"):
            metrics.make_service(settings["metrics-listen"], reactor, clock).setServiceParent(root)
        for module in _wing_modules("service"):
            service = module.make_service(settings, reactor, clock)
            if service is not None:
                service.setServiceParent(root)
    except ConfigError as e:
        sys.stderr.write(f"relayd: error: {e}\n")
        sys.stderr.flush()
        raise SystemExit(2)
    configure_children(root, settings)
    return root


def configure_children(root: MultiService, settings: Resolved) -> None:
    """Apply the process-wide settings to every relay's site and shutdown, and watch its connections."""
    watching = metrics.Watching()
    for child in list(root):
        if hasattr(child, "grace") and "shutdown-grace" in settings.values:
            child.grace = settings["shutdown-grace"]
        site = getattr(child, "site", None)
        if not isinstance(site, RelaySite):
            continue
        if site.relay is None:
            site.relay = child.name or "http"
        site.trust_forwarded_for = settings.values.get("trust-forwarded-for", 0)
        site.header_timeout = settings.values.get("header-timeout", site.header_timeout)
        site.body_timeout = settings.values.get("body-timeout", site.body_timeout)
        site.timeOut = settings.values.get("idle-timeout", site.timeOut)
        site.access_log = not settings.values.get("no-access-log", False)
        watching.add(metrics.http_connections, site.open_connections, relay=site.relay)
    watching.setServiceParent(root)
