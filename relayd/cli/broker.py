"""C{relayd-admin broker issue|revoke|list}: credentials for keyless agents.

C{issue} binds a new credential to one agent identity, a channel scope and an action set, and
prints C{{"credential": ..., "agentPubkey": ...}} once: only its SHA-256 is stored. The agent's key
is imported from C{--secret-key-file} (64 hex or nsec1), reused when the named agent already exists
(e.g. a managed agent created through C{agents.create}), or minted; it is kept sealed under the
key-encryption key. C{list} and C{revoke} never print secrets.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from typing import Sequence, TextIO

from relayd.base.clock import BlockingClock
from relayd.buzz import nostr
from relayd.buzz.config import KEK_ENV
from relayd.buzz.core import contract
from relayd.buzz.core.host import CHANNEL_ACTIONS, credential_hash
from relayd.buzz.core.keys import Custody, KEKError, load_kek
from relayd.buzz.core.state import DB_FILE_NAME, Agent, StateDB
from relayd.cli import CommandError, Failure, Parser, report
from relayd.cli import UsageError as _UsageError

CREDENTIAL_PREFIX = "bzh_"
# Actions a credential without channels could never perform: those naming a channel, and managing an
# agent, which needs the agent's channel in the credential's scope.
NEEDS_A_CHANNEL = CHANNEL_ACTIONS | {"agents.update", "agents.delete"}


def new_credential() -> str:
    """C{bzh_} + base64url(32 random bytes), unpadded."""
    return CREDENTIAL_PREFIX + base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode("ascii")


DEFAULT_STATE_DIR = "./relayd-state"  # as the broker's --broker-state-dir


def _parser() -> argparse.ArgumentParser:
    """The command line, in relayd/cli.py's style (tests/test_help.py checks every help text)."""
    p = Parser(prog="relayd-admin broker", description="Manage Buzz broker credentials")
    sub = p.add_subparsers(dest="command", required=True, metavar="{issue,revoke,list}")

    def common(sp: argparse.ArgumentParser) -> None:
        # Defaults resolved after parsing, so that --help shows where they come from, not this shell's values.
        sp.add_argument(
            "--state-dir",
            metavar="DIR",
            help=f"The broker's state directory (its --broker-state-dir) [default: $RELAYD_BROKER_STATE_DIR, "
            f"else {DEFAULT_STATE_DIR}]",
        )
        sp.add_argument(
            "--kek-file",
            metavar="FILE",
            help="File holding the 64-hex-character key-encryption key (the broker's --broker-kek-file) "
            f"[default: $RELAYD_BROKER_KEK_FILE, else ${KEK_ENV}, else the state directory's generated key]",
        )
        sp.set_defaults(prog=sp.prog)

    channel_actions = [a for a in contract.ACTIONS if a in NEEDS_A_CHANNEL]
    other_actions = [a for a in contract.ACTIONS if a not in NEEDS_A_CHANNEL]
    issue = sub.add_parser("issue", help="Issue a credential (printed once)")
    common(issue)
    issue.add_argument("--agent", required=True, help="Agent name (or public key of an existing agent)")
    issue.add_argument(
        "--channel",
        action="append",
        default=[],
        metavar="UUID",
        help="Channel UUID the credential may act in (repeatable; required when --actions names a channel "
        "action)",
    )
    issue.add_argument(
        "--actions",
        default=",".join(contract.ACTIONS),
        metavar="LIST",
        help=f"Comma-separated broker actions the credential may perform, of the nine: "
        f"{', '.join(channel_actions)} (these need --channel), {', '.join(other_actions)} [default: all nine]",
    )
    issue.add_argument("--secret-key-file", metavar="FILE", help="File holding the agent's key (64 hex or nsec1) "
                       "[default: the existing agent's key, else a new one]")
    issue.add_argument("--owner", metavar="PUBKEY", help="Public key of the agent's owner (for storage.address)")
    issue.add_argument(
        "--expires",
        metavar="WHEN",
        help="When the credential stops working: a duration (90s, 30m, 12h, 7d) from now, or an ISO 8601"
        " date-time with a zone (2027-01-31T00:00:00Z) [default: never]",
    )

    revoke = sub.add_parser("revoke", help="Revoke credentials")
    common(revoke)
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", help="Credential id (from list)")
    which.add_argument("--agent", help="Revoke every credential of this agent (name or public key)")

    lst = sub.add_parser("list", help="List credentials and agents (no secrets)")
    common(lst)
    return p


def main(
    argv: Sequence[str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    clock: BlockingClock | None = None,
) -> int:
    """Run C{relayd-admin broker ...} with C{argv} (without the leading C{broker}); returns the exit status.

    C{clock} stamps what is issued and revoked and judges expiry (a test's own, else the system's).
    """
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except CommandError as e:
        return report(err, e, parser.prog)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    args.state_dir = args.state_dir or os.environ.get("RELAYD_BROKER_STATE_DIR") or DEFAULT_STATE_DIR
    args.kek_file = args.kek_file or os.environ.get("RELAYD_BROKER_KEK_FILE") or None
    try:
        return _run(args, out, err, clock or BlockingClock())
    except CommandError as e:
        return report(err, e, args.prog)
    except Exception as e:  # never a traceback for an operator: one line, and the kind of fault
        return report(err, Failure(f"unexpected {type(e).__name__}: {e}"), args.prog)


def _run(args: argparse.Namespace, out: TextIO, err: TextIO, clock: BlockingClock) -> int:
    if args.command != "issue" and not os.path.isdir(args.state_dir):
        # Only issue may start a state directory: list or revoke on a mistyped one would create it.
        raise Failure(f"no broker state in {args.state_dir!r} (--state-dir, or RELAYD_BROKER_STATE_DIR)")
    new_state = not os.path.exists(os.path.join(args.state_dir, DB_FILE_NAME))
    try:
        db = StateDB.in_dir(args.state_dir)
    except Exception as e:
        raise Failure(f"cannot open the state in {args.state_dir!r}: {e}") from None
    db.now = clock.wall
    try:
        if args.command == "issue":
            status = _issue(args, db, out, err, clock)
            if new_state and status == 0:
                # The commonest mistake: issuing from another directory than relayd's (the default is
                # relative) makes a state relayd never reads, and a credential that can never work.
                where = os.path.abspath(args.state_dir)
                err.write(
                    f"{args.prog}: warning: {where!r} held no broker state: a new one was created there; "
                    f"relayd accepts this credential only if it runs with --broker-state-dir {where}\n"
                )
            return status
        if args.command == "revoke":
            return _revoke(args, db, out, err)
        return _list(db, out, clock)
    finally:
        db.close()


def _custody(args: argparse.Namespace) -> Custody:
    try:
        return Custody(load_kek(args.state_dir, args.kek_file, os.environ.get(KEK_ENV) or None))
    except KEKError as e:
        # load_kek names the daemon's flag; here the same file was given as --kek-file.
        raise _UsageError(str(e).replace("--broker-kek-file", "--kek-file")) from None


def _find_agent(db: StateDB, ref: str) -> Agent | None:
    try:
        pk = contract.pubkey(ref)
    except contract.ContractError:
        pk = None
    if pk is not None:
        a = db.agent(pk)
        if a is not None and not a.deleted:
            return a
    named = [a for a in db.agents_named(None, contract.trim(ref))]
    if len(named) > 1:
        raise _UsageError(f"more than one agent is named {ref!r}; use its public key")
    return named[0] if named else None


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_expires(text: str, now: float) -> int:
    """The unix time C{--expires} names: a duration from C{now} (C{90s}, C{12h}, C{7d}) or an ISO 8601
    date-time with a zone. It must lie in the future."""
    import datetime

    value = text.strip()
    if len(value) > 1 and value[-1] in _UNITS and value[:-1].isdigit() and len(value) <= 12:
        at = int(now) + int(value[:-1]) * _UNITS[value[-1]]
    else:
        try:
            when = datetime.datetime.fromisoformat(value)  # Python 3.11 reads a trailing Z
        except ValueError:
            raise _UsageError("--expires: not a duration (90s, 30m, 12h, 7d) or an ISO 8601 date-time") from None
        if when.tzinfo is None:
            raise _UsageError("--expires: give the date-time a zone (Z or +hh:mm)")
        at = int(when.timestamp())
    if at <= now:
        raise _UsageError("--expires: must be in the future")
    return at


def _issue(args: argparse.Namespace, db: StateDB, out: TextIO, err: TextIO, clock: BlockingClock) -> int:
    try:
        channels = sorted({contract.channel_id(c, "--channel") for c in args.channel})
        owner = contract.pubkey(args.owner, "--owner") if args.owner else None
    except contract.ContractError as e:
        raise _UsageError(e.message) from None
    actions = sorted({a.strip() for a in args.actions.split(",") if a.strip()})
    unknown = [a for a in actions if a not in contract.ACTIONS]
    if unknown or not actions:
        raise _UsageError(f"--actions: unknown action {unknown[0]!r}" if unknown else "--actions: empty")
    in_channels = [a for a in actions if a in NEEDS_A_CHANNEL]
    if in_channels and not channels:
        # Without a channel these actions are always refused: say so now rather than hand out a
        # credential that silently cannot post or read anywhere.
        raise _UsageError(
            f"--channel is required for {', '.join(in_channels)} (repeat it for each channel); "
            "without a channel, --actions may only name "
            + ",".join(a for a in contract.ACTIONS if a not in NEEDS_A_CHANNEL)
        )
    expires_at = parse_expires(args.expires, clock.wall()) if args.expires is not None else None
    custody = _custody(args)
    existing = _find_agent(db, args.agent)
    if args.secret_key_file:
        try:
            with open(args.secret_key_file, encoding="utf-8") as f:
                secret = nostr.parse_secret_key(f.read())
        except OSError as e:
            raise _UsageError(f"--secret-key-file: cannot read ({e.strerror})") from None
        except ValueError as e:
            raise _UsageError(f"--secret-key-file: {e}") from None
        signer = nostr.Signer(secret)
        if existing is not None and existing.pubkey != signer.pubkey:
            raise _UsageError(f"agent {args.agent!r} already exists with a different key")
        existing = db.agent(signer.pubkey) if existing is None else existing
    elif existing is None:
        secret = nostr.generate_secret()
        signer = nostr.Signer(secret)
    else:
        signer = None  # reuse the stored key
    if existing is not None and signer is None:
        agent = existing
        if owner is not None and owner != existing.owner:
            if existing.managed:
                raise _UsageError("a managed agent's owner is the agent that created it")
            agent = Agent(**{**existing.__dict__, "owner": owner})
            db.put_agent(agent)
    else:
        assert signer is not None
        base = existing if existing is not None and existing.pubkey == signer.pubkey else None
        name = base.name if base is not None else contract.trim(args.agent)
        agent = Agent(
            pubkey=signer.pubkey,
            name=name,
            sealed_key=custody.seal(signer.secret, signer.pubkey),
            owner=owner if owner is not None else (base.owner if base else None),
            managed=base.managed if base else False,
            depth=base.depth if base else 0,
            channel=base.channel if base else None,
            settings=base.settings if base else {},
            record_created_at=base.record_created_at if base else 0,
            deleted=False,
        )
        db.put_agent(agent)
    credential = new_credential()
    db.add_credential(credential_hash(credential), agent.pubkey, channels, actions, expires_at)
    line: dict[str, object] = {"credential": credential, "agentPubkey": agent.pubkey}
    if expires_at is not None:
        line["expiresAt"] = expires_at
    out.write(json.dumps(line) + "\n")
    out.flush()
    return 0


def _revoke(args: argparse.Namespace, db: StateDB, out: TextIO, err: TextIO) -> int:
    if args.id:
        n = db.revoke(credential_id=args.id.strip())
    else:
        agent = _find_agent(db, args.agent)
        if agent is None:
            raise Failure(f"no agent {args.agent!r}")
        n = db.revoke(agent_pubkey=agent.pubkey)
    out.write(json.dumps({"revoked": n}) + "\n")
    return 0 if n else 1


def _list(db: StateDB, out: TextIO, clock: BlockingClock) -> int:
    now = clock.wall()
    agents = {a.pubkey: a for a in db.agents()}
    for cred in db.credentials():
        a = agents.get(cred.agent_pubkey)
        out.write(
            json.dumps(
                {
                    "id": cred.id,
                    "agent": a.name if a else None,
                    "agentPubkey": cred.agent_pubkey,
                    "channels": sorted(cred.channels),
                    "actions": sorted(cred.actions),
                    "revoked": cred.revoked,
                    "createdAt": cred.created_at,
                    "expiresAt": cred.expires_at,
                    "expired": cred.expired(now),
                }
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
