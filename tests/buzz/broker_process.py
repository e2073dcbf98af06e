"""Run a broker in its own process (for kill -9 tests); prints its HTTP port on stdout.

usage: python broker_process.py STATE_DIR RELAY_URL [CRASH_AT]
CRASH_AT: "after_store" kills the process right after the signed events are stored;
          "on_ok" kills it when the relay's OK for a published event arrives, before it is handled.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> None:
    state_dir, relay_url = sys.argv[1], sys.argv[2]
    crash_at = sys.argv[3] if len(sys.argv) > 3 else ""
    from twisted.internet import reactor

    from relayd.buzz import nostr_client, state
    from relayd.buzz.service import BrokerService
    from relayd.clock import Clock

    def die(*_: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if crash_at == "after_store":
        original = state.SQLiteState.store_plan

        def store_plan(self, *a):  # type: ignore[no-untyped-def]
            return original(self, *a).addCallback(die)

        state.SQLiteState.store_plan = store_plan  # type: ignore[method-assign]
    elif crash_at == "on_ok":
        original_ok = nostr_client.RelayConnection._ok

        def _ok(self, event_id, accepted, message):  # type: ignore[no-untyped-def]
            if event_id:
                die()
            return original_ok(self, event_id, accepted, message)

        nostr_client.RelayConnection._ok = _ok  # type: ignore[method-assign]
    with open(os.path.join(state_dir, "test.kek")) as f:
        kek = bytes.fromhex(f.read().strip())
    svc = BrokerService(
        listen=["tcp:0:interface=127.0.0.1"],
        relay_url=relay_url,
        auth_url=None,
        db=state.StateDB.in_dir(state_dir),
        kek=kek,
        reactor=reactor,
        clock=Clock(reactor),
        timeout=10.0,
    )

    def started() -> None:
        svc.startService()
        svc.ports().addCallback(lambda ports: (print(f"PORT {ports[0].getHost().port}", flush=True)))

    reactor.callWhenRunning(started)
    reactor.addSystemEventTrigger("before", "shutdown", svc.stopService)
    reactor.run()


if __name__ == "__main__":
    main()
