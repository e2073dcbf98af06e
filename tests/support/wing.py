"""One wing of relayd (C{aep}, C{mcp} or C{buzz}) started in-process on 127.0.0.1 port 0.

The wing is built the way C{relayd.tap.makeService} builds it (L{Plumbing} from the resolved
settings, then the wing's own C{make_wing}), on the real reactor, with a clock of its own; with
C{--redis} the start waits until the pool is connected and every subscription is up, as a fresh
process does before it serves. Stopping it is what the process does at exit: stop the wing (it
drains), close the plumbing's Redis client, cancel the clock's timers.

    wing = await start_wing(self, "mcp", {"mcp-ttl-ms": "1000"})   # stopped at cleanup
    wing.url                                                         # http://127.0.0.1:PORT
    wing.service, wing.clock, wing.settings

For a real C{twistd -n relayd} process see L{tests.support.twistd}.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

import relayd.storage.redis
from relayd.base.clock import Timekeeper
from relayd.base.config import Resolved, resolve
from relayd.process.settings import SETTINGS as PROCESS_SETTINGS
from relayd.wing import Plumbing

TIMEOUT = 5.0
LOOPBACK = "tcp:0:interface=127.0.0.1"


class Wing:
    """A wing's service started in-process (see the module docstring); L{start}, then L{stop}."""

    def __init__(self, name: str, settings: Resolved, service: Any, plumbing: Plumbing) -> None:
        self.name = name
        self.settings = settings
        self.service = service
        self.plumbing = plumbing
        self.clock = plumbing.clock
        self.port = 0
        self.url = ""

    @classmethod
    async def start(cls, name: str, given: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Wing:
        """Start wing C{name} with C{given} settings (as the command line gives them: names without
        C{--}, list values for repeatable flags) over C{environ} (none of the caller's by default).
        Its listener is on a free loopback port unless C{given} names one."""
        config = importlib.import_module(f"relayd.{name}.config")
        make_wing = importlib.import_module(f"relayd.{name}.service").make_wing
        (listen,) = [setting.name for setting in config.SETTINGS if setting.name.endswith("-listen")]  # buzz: broker-listen
        flags = {listen: [LOOPBACK], **(given or {})}
        settings = resolve([*PROCESS_SETTINGS, *config.SETTINGS], flags, dict(environ or {}))
        plumbing = Plumbing.from_settings(settings, reactor, Timekeeper(reactor))
        service = make_wing(plumbing, settings)
        assert service is not None, f"the {name} wing is disabled by {flags}"
        wing = cls(name, settings, service, plumbing)
        service.startService()
        try:
            await wing.ready()
            ports = await service.ports()
        except BaseException:
            await wing.stop()
            raise
        wing.port = ports[0].getHost().port
        wing.url = f"http://127.0.0.1:{wing.port}"
        return wing

    def redis_clients(self) -> list[relayd.storage.redis.Redis]:
        """The plumbing's Redis client (with C{--redis}), which this wing's owner closes."""
        return [] if self.plumbing.redis is None else [self.plumbing.redis]

    async def ready(self, timeout: float = TIMEOUT) -> None:
        """Until every Redis pool of the wing is connected and every subscription is up."""
        # With Redis, a fresh process answers 503 until its pool is up; tests start after that.
        for client in self.redis_clients():
            waited = 0.0
            while not client.connected:
                if waited > timeout:
                    raise AssertionError(f"Redis pool did not connect to {client.url}")
                await deferLater(reactor, 0.01, lambda: None)  # polling a connection being made
                waited += 0.01
            for bus in client._buses:
                await bus.ready
        # The MCP wing's bus subscribes on a connection of its own (not one of the client's buses).
        bus = getattr(getattr(self.service, "tunnel", None), "bus", None)
        if getattr(bus, "remote", False):
            await bus.ready

    async def stop(self) -> None:
        """Stop the wing (it drains its clients), close its Redis clients, cancel its timers."""
        if self.service.running:
            await self.service.stopService()
        for client in self.redis_clients():
            await client.close()
        self.clock.shutdown()


async def start_wing(
    case: TestCase, name: str, given: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Wing:
    """L{Wing.start}, stopped at C{case}'s cleanup (after every client the test opens later)."""
    wing = await Wing.start(name, given, environ)
    case.addCleanup(wing.stop)
    return wing
