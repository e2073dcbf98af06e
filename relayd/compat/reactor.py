"""The fence's reactor entry: the epoll reactor's dispatch of an I/O event, with the log context
Twisted gives it, without the calls Twisted makes to give it.

Twisted's C{EPollReactor.doPoll} hands each event to C{log.callWithLogger(selectable,
_doReadOrWrite, selectable, fd, event)}, which goes through eight Python calls (C{callWithLogger},
C{log.callWithContext}, and C{context.get} and C{context.call}, each three: the thread's tracker, its
C{currentContext}, the C{ContextTracker}'s method) to push
C{{ILogContext: copy of the current one, "system" set to selectable.logPrefix()}} on the thread's
context stack for the call: about 1.2 us per event against 0.04 us for the call itself, a few per
cent of every request. L{quick_dispatch} gives the process's epoll reactor a C{doPoll} that pushes
and pops the same dictionary itself: one event per keep-alive POST went from 161,000 to 149,800
instructions per request (-6.9 %), on --redis from 397,200 to 382,700 (-3.7 %), a connection per
event from 279,700 to 267,900 (-4.2 %), an MCP endpoint round trip from 650,600 to 633,500 (-2.6 %)
(callgrind, docs/performance.md "the epoll reactor's event dispatch without callWithLogger").
"""

from __future__ import annotations

import errno
from types import MethodType
from typing import Any

from twisted.internet.epollreactor import EPollReactor
from twisted.python import context, log
from twisted.python.log import ILogContext

from relayd.compat.detect import code_uses

# What the per-event code stands in for, as imported: a patch of any of them (a test's) sends the
# reactor back to Twisted's own doPoll from its next poll on.
_CALL_WITH_LOGGER = log.callWithLogger
_CALL_WITH_CONTEXT = log.callWithContext
_GET = context.get
_CALL = context.call
_TRACKER = context.theContextTracker

QUICK_DISPATCH = (
    code_uses(EPollReactor.doPoll, "callWithLogger", "_doReadOrWrite", "_selectables", "poll")
    and EPollReactor.__dict__.get("doIteration") is EPollReactor.doPoll
    and code_uses(_CALL_WITH_LOGGER, "logPrefix", "callWithContext", "err", "KeyboardInterrupt", "BaseException")
    and code_uses(_CALL_WITH_CONTEXT, "get", "copy", "update", "call")
    and type(_TRACKER) is context.ThreadedContextTracker
    and _GET == _TRACKER.getContext
    and _CALL == _TRACKER.callWithContext
    and code_uses(context.ThreadedContextTracker.getContext, "currentContext", "getContext")
    and code_uses(context.ThreadedContextTracker.callWithContext, "currentContext", "callWithContext")
    and code_uses(context.ContextTracker.callWithContext, "contexts", "append", "pop")
    and code_uses(context.ContextTracker.getContext, "contexts", "reversed")
)
"""C{EPollReactor.doPoll} (its C{doIteration}) hands each event to C{log.callWithLogger}, which
pushes C{{ILogContext: dict}} on the calling thread's C{ContextTracker.contexts} for the call, as
C{context.call} does, the dictionary copied from C{context.get(ILogContext)}, a walk down that list."""


def quick_dispatch(reactor: Any) -> bool:
    """Have C{reactor}, the process's epoll reactor, handle its I/O events through L{_do_poll}
    (C{True} once it does); C{False}, nothing changed, when it is not Twisted's C{EPollReactor}
    itself, its dispatch is not the one this knows, or its C{doIteration} is already another's hook
    (relayd/compat/logger.py C{before_each_poll}'s, which calls what was there: so this goes first).
    Installed once, on the instance: calling it again changes nothing, a hook put over it kept."""
    if not QUICK_DISPATCH or type(reactor) is not EPollReactor:
        return False
    installed = vars(reactor)
    if getattr(installed.get("doPoll"), "__func__", None) is _do_poll:
        return True
    if "doIteration" in installed:
        return False
    # (ReactorBase's mainLoop and iterate call doIteration, the class's doPoll.)
    reactor.doIteration = reactor.doPoll = MethodType(_do_poll, reactor)  # type: ignore[method-assign]
    return True


def _do_poll(self: Any, timeout: float | None) -> None:
    """C{EPollReactor.doPoll}, with C{log.callWithLogger(selectable, _doReadOrWrite, ...)} written
    out: the same steps, in the same order, on the same objects.

    - C{logPrefix()} is asked first; when it raises (but for C{KeyboardInterrupt}), C{lp} is
      C{"(buggy logPrefix method)"} and C{log.err(system=lp)} logs it.
    - The log context: C{log.callWithContext} copies C{context.get(ILogContext)} (the value of the
      nearest entry of the thread's context list that has the key, C{None} when none has: its
      C{copy} then raises, logged as below and the event not handled, as Twisted does) and updates
      the copy with C{{"system": lp}}. Looking in the top entry first and walking the list only
      when that misses finds the same value.
    - C{context.call} appends C{{ILogContext: copy}} itself, not the top entry merged with it: the
      thread pool's C{callInThreadWithCallback} carries C{contexts[-1]} alone into its worker, so a
      merged top would hand a worker keys that Twisted's does not. Popped after, also when the call
      raises.
    - An exception out of the context step or C{_doReadOrWrite} (but C{KeyboardInterrupt}) is
      logged with C{log.err(system=lp)}, in the context outside the event's, and the loop goes on.

    The patch check is per poll, not per event: a patch made while a poll's events are handled
    applies from the next poll.
    """
    if (
        log.callWithLogger is not _CALL_WITH_LOGGER
        or log.callWithContext is not _CALL_WITH_CONTEXT
        or context.get is not _GET
        or context.call is not _CALL
    ):
        EPollReactor.doPoll(self, timeout)
        return
    if timeout is None:
        timeout = -1  # Wait indefinitely.
    try:
        events = self._poller.poll(timeout, len(self._selectables))
    except OSError as err:
        if err.errno == errno.EINTR:
            return
        raise

    tracker = _TRACKER.currentContext()
    contexts = tracker.contexts
    selectables = self._selectables
    drdw = self._doReadOrWrite
    for fd, event in events:
        try:
            selectable = selectables[fd]
        except KeyError:
            continue
        try:
            lp = selectable.logPrefix()
        except KeyboardInterrupt:
            raise
        except BaseException:
            lp = "(buggy logPrefix method)"
            log.err(system=lp)
        try:
            try:
                current = contexts[-1][ILogContext]
            except KeyError:
                current = tracker.getContext(ILogContext)
            pushed = current.copy()
            pushed.update({"system": lp})
            contexts.append({ILogContext: pushed})
            try:
                drdw(selectable, fd, event)
            finally:
                contexts.pop()
        except KeyboardInterrupt:
            raise
        except BaseException:
            log.err(system=lp)
