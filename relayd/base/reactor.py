"""What relayd needs of a reactor, as one type: L{IReactor}.

Twisted's reactor has no single interface: each capability (time, TCP, threads, ...) is its own
zope interface. L{IReactor} extends the ones relayd uses, so mypy (with mypy-zope, which treats
interface inheritance as subclassing) checks every call made on it and accepts it wherever Twisted
asks for one of them (C{deferToThreadPool} an C{IReactorFromThreads}, C{addTimeout} an
C{IReactorTime}). A C{typing.Protocol} would not do: mypy-zope compares interfaces nominally, so a
protocol is never an C{IReactorTime}.

No reactor declares L{IReactor}; it is a static type only. L{installed} hands out the process's
reactor under it. Timers do not take the reactor: they go through L{relayd.base.clock.Timekeeper}, which needs
only C{IReactorTime} (tests hand it a C{task.Clock}).
"""

from __future__ import annotations

from typing import cast

from twisted.internet.interfaces import (
    IReactorCore,
    IReactorFromThreads,
    IReactorPluggableNameResolver,
    IReactorSocket,
    IReactorSSL,
    IReactorTCP,
    IReactorTime,
    IReactorUNIX,
)


class IReactor(
    IReactorCore,
    IReactorTime,
    IReactorFromThreads,
    IReactorTCP,
    IReactorUNIX,
    IReactorSSL,
    IReactorSocket,
    IReactorPluggableNameResolver,
):
    """The reactor relayd runs on: stopping (C{IReactorCore}), time (for the clock alone), results
    from worker threads, and what the listener and client endpoints need (TCP, Unix sockets, TLS,
    inherited systemd sockets, name resolution)."""


def installed() -> IReactor:
    """The process's installed reactor (importing it installs the default one if none is)."""
    from twisted.internet import reactor

    return cast(IReactor, reactor)
