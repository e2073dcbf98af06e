"""The nine broker operations, mapped onto Nostr (docs/broker.md section 2, docs/decisions.md).

An operation either answers directly (C{channel.read}, C{storage.address}, a no-op update) or
returns a L{Plan}: the fully signed events to publish, in order, the outcome they produce and the
local effects to apply once the relay accepted them. The host stores the plan before sending
anything, which is what makes a retry after a crash resend the identical events.

About 600 lines, for a reason: the nine operations are one table of meanings on one upstream
(reads, signing, the checks each operation makes against the relay's current state) and are read
side by side when the contract changes; what a landed event is (L{Operations.landed}) belongs to the
same reading of the relay.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson
from twisted.logger import Logger

from relayd.buzz import nostr
from relayd.buzz.core import contract, cursor
from relayd.buzz.core.keys import Custody
from relayd.buzz.core.state import STAMP_DIGEST_BYTES, Agent, IAgentStore
from relayd.buzz.nostr_upstream import NostrRelayPool

Event = dict[str, Any]
_SAME_SECOND_LIMIT = 5000


class ActionFailed(Exception):
    """The action ran and reported a domain failure (C{failed}/C{action_failed}); nothing published."""


class Unauthorized(Exception):
    """Authenticated but not permitted (C{failed}/C{unauthorized})."""


class Unsupported(Exception):
    """The host knows the action but does not offer it (C{failed}/C{unsupported})."""


class InvalidArgs(Exception):
    """Arguments that only the host can judge invalid (a foreign cursor): C{invalid_request}."""


@dataclass
class Plan:
    """What an execution will publish and change; serialisable so it survives a crash."""

    action: str
    outcome: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)  # {"by": pubkey, "event": ev}
    effects: list[dict[str, Any]] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)  # sealed keys of identities not yet stored
    # SHA-256 hex of the credential that made the plan (never the credential): a retry under another
    # credential of the same agent must not send what a revoked or expired one planned. "" in plans
    # stored before it was recorded.
    credential: str = ""

    def to_bytes(self) -> bytes:
        d = {"action": self.action, "outcome": self.outcome, "events": self.events, "effects": self.effects, "keys": self.keys}
        if self.credential:
            d["credential"] = self.credential
        return contract.dumps(d)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Plan":
        d = orjson.loads(data)
        return cls(d["action"], d["outcome"], d["events"], d["effects"], d["keys"], d.get("credential", ""))


@dataclass(frozen=True)
class Context:
    """Who is acting: the agent the credential is bound to, and its signer."""

    agent: Agent
    signer: nostr.Signer
    channels: frozenset[str] = frozenset()  # the credential's channels (scope of agents.update/delete)


class Operations:
    """Executes the nine operations for an authenticated, authorised requester."""

    _log = Logger()

    def __init__(
        self,
        agents: IAgentStore,
        pool: NostrRelayPool,
        custody: Custody,
        *,
        timeout: float,
        now: Callable[[], float],
        runtimes: list[str],
        reactions_enabled: bool = True,
    ) -> None:
        self.agents = agents
        self.pool = pool
        self.custody = custody
        self.timeout = timeout
        self.now = now
        self.runtimes = frozenset(runtimes)
        self.reactions_enabled = reactions_enabled
        self.cursor_key = cursor.derive_key(custody.derive(b"cursor"))
        self._signers: dict[str, nostr.Signer] = {}

    # --- identities

    def signer_for(self, agent: Agent) -> nostr.Signer:
        """The signer of a stored agent (cached; the sealed key is opened once)."""
        s = self._signers.get(agent.pubkey)
        if s is None:
            if agent.sealed_key is None:
                raise Unauthorized("this identity has no key on this host")
            s = nostr.Signer(self.custody.open(agent.sealed_key, agent.pubkey))
            self._signers[agent.pubkey] = s
            if agent.attestation:
                self.pool.attestations[agent.pubkey] = list(agent.attestation)
        return s

    def forget(self, pubkey: str) -> None:
        self._signers.pop(pubkey, None)
        self.pool.forget(pubkey)

    async def signer_by_pubkey(self, pubkey: str, plan: Plan) -> nostr.Signer:
        """The signer for an event of a plan: a stored agent, or a key minted by the plan itself."""
        if pubkey in self._signers:
            return self._signers[pubkey]
        if pubkey in plan.keys:
            s = nostr.Signer(self.custody.open(bytes.fromhex(plan.keys[pubkey]), pubkey))
            self._signers[pubkey] = s
            for effect in plan.effects:  # a key minted by agents.create: its owner's attestation too
                if effect["op"] == "create_agent" and effect["agent"]["pubkey"] == pubkey and effect["agent"].get("attestation"):
                    self.pool.attestations[pubkey] = list(effect["agent"]["attestation"])
            return s
        agent = await self.agents.agent(pubkey)
        if agent is None:
            raise ActionFailed("signing identity no longer exists")
        return self.signer_for(agent)

    async def superseded(self, plan: Plan) -> str | None:
        """Why resending a stored plan would overwrite newer state (C{None}: it would not).

        A plan waits while its request is C{indeterminate}; by the retry the agent it changes may
        have been updated (a newer record) or deleted, or one of its signers may be gone.
        """
        for effect in plan.effects:
            op = effect["op"]
            pubkey = effect["agent"]["pubkey"] if op == "create_agent" else effect["pubkey"]
            agent = await self.agents.agent(pubkey)
            if op == "update_agent":
                if agent is None or agent.deleted:
                    return "the agent was deleted after this request was planned"
                if agent.record_created_at > effect["record_created_at"]:
                    return "the agent was changed by a later request"
            elif op == "create_agent" and agent is not None and agent.deleted:
                return "the agent was deleted after this request was planned"
        for item in plan.events:
            if item["by"] in plan.keys:
                continue
            agent = await self.agents.agent(item["by"])
            if agent is None or agent.deleted or agent.sealed_key is None:
                return "a signing identity was deleted after this request was planned"
        return None

    async def landed(self, reader: nostr.Signer, plan: Plan, confirmed: int = 0) -> list[bool]:
        """Which events of C{plan} are on the relay, asked as C{reader} (one REQ; see L{on_relay}).

        C{confirmed}: how many leading events the relay accepted in this attempt.
        @raise UpstreamError: the relay could not be asked (the answer is unknown).
        """
        events = [item["event"] for item in plan.events]
        found = await self.pool.connection(reader).query(evidence_filters(events), self.timeout)
        return on_relay(events, found, confirmed)

    async def _sign(
        self, signer: nostr.Signer, kind: int, tags: list[list[str]], content: str, after: int = -1, strict: bool = False
    ) -> Event:
        """Sign a new event of C{signer} at a C{created_at} its clock hands out (after C{after}).

        Two requests are two messages: an event identical to one this identity already has in the
        same second would get the same id and the relay would keep one, so the state store's clock
        moves such an event to a later second (L{IAgentStore.stamp}).
        """
        digest = hashlib.sha256(nostr.serialize_for_id("", 0, kind, tags, content)).digest()[:STAMP_DIGEST_BYTES]
        created_at = await self.agents.stamp(signer.pubkey, digest, int(self.now()), after, strict)
        return signer.sign(kind, tags, content, created_at)

    async def _query(self, ctx: Context, filters: list[dict[str, Any]]) -> list[Event]:
        return await self.pool.connection(ctx.signer).query(filters, self.timeout)

    async def _fetch(self, ctx: Context, event_id: str) -> Event | None:
        for ev in await self._query(ctx, [{"ids": [event_id], "limit": 1}]):
            if ev.get("id") == event_id:
                return _checked(ev)
        return None

    # --- dispatch

    async def run(self, ctx: Context, req: contract.Request) -> Plan:
        """Execute or plan C{req}; a plan without events is a final answer."""
        handler = getattr(self, "_" + req.action.replace(".", "_"))
        return await handler(ctx, req.args)

    # --- channel.read

    async def _channel_read(self, ctx: Context, args: dict[str, Any]) -> Plan:
        ch = args["channelId"]
        limit = args.get("limit", contract.DEFAULT_LIMIT)
        root = args.get("rootEventId", "")
        mentions_only = bool(args.get("mentionsOnly", False))
        scope = cursor.Scope(ctx.agent.pubkey, ch, root, mentions_only)
        pos = None
        if "cursor" in args:
            try:
                pos = cursor.open_cursor(self.cursor_key, scope, args["cursor"])
            except cursor.CursorError as e:
                raise InvalidArgs(str(e)) from None
        base: dict[str, Any] = {"kinds": [nostr.KIND_CHANNEL_MESSAGE], "#h": [ch]}
        if mentions_only:
            base["#p"] = [ctx.agent.pubkey]
        if root:
            base["#e"] = [root]

        def wanted(ev: Event) -> bool:
            if ev["kind"] != nostr.KIND_CHANNEL_MESSAGE or ch not in nostr.tag_values(ev, "h"):
                return False
            if mentions_only and ctx.agent.pubkey not in nostr.tag_values(ev, "p"):
                return False
            if root and ev["id"] != root and root not in nostr.tag_values(ev, "e"):
                return False
            return pos is None or pos.is_after(ev["created_at"], ev["id"])

        found: dict[str, Event] = {}

        def take(events: list[Event]) -> list[Event]:
            kept = []
            for raw in events:
                ev = _checked(raw)
                if ev is not None and wanted(ev):
                    found.setdefault(ev["id"], ev)
                    kept.append(ev)
            return kept

        need = limit + 1  # one more than the page, so the page knows whether more exist
        if pos is None:
            asked = need
            raw = await self._query(ctx, [{**base, "limit": asked}])
        else:
            # Events of the cursor's own second after its id: the relay cannot page inside a second.
            same = await self._query(
                ctx, [{**base, "since": pos.created_at, "until": pos.created_at + 1, "limit": _SAME_SECOND_LIMIT}]
            )
            take(same)
            at_cursor = sum(1 for e in same if e.get("created_at") == pos.created_at)
            # `until` is inclusive in NIP-01 and exclusive on some relays: ask for enough to cover both.
            asked = need + at_cursor
            raw = await self._query(ctx, [{**base, "until": pos.created_at, "limit": asked}])
        take(raw)
        floor = None
        if len(raw) >= asked:
            # Truncated: the oldest second returned may be partial (relays order by created_at only).
            floor = min(int(e["created_at"]) for e in raw if isinstance(e.get("created_at"), int))
            newer = sum(1 for e in found.values() if e["created_at"] > floor)
        if floor is not None and newer < limit:
            # The page reaches into the floor second: it needs all of that second, in id order.
            take(
                await self._query(
                    ctx, [{**base, "since": floor, "until": floor + 1, "limit": _SAME_SECOND_LIMIT}]
                )
            )
        if root and root not in found:
            head = await self._fetch(ctx, root)
            if head is not None and wanted(head) and (floor is None or head["created_at"] >= floor):
                found[head["id"]] = head
        # Seconds older than the floor are not known complete; a floor second not fetched in full
        # only contributes the look-ahead that proves more exist (it sorts after a full page).
        ordered = sorted(
            (e for e in found.values() if floor is None or e["created_at"] >= floor), key=nostr.newest_first_key
        )
        page = contract.CheckedEvents(ordered[:limit])  # each came out of contract.signed_event
        outcome: dict[str, Any] = {"messages": page}
        if len(ordered) > limit and page:
            last = page[-1]
            outcome["nextCursor"] = cursor.issue(
                self.cursor_key, scope, cursor.Position(last["created_at"], last["id"])
            )
        return Plan("channel.read", outcome)

    # --- publishing operations

    async def _publish_plan(
        self, action: str, signer: nostr.Signer, kind: int, tags: list[list[str]], content: str, after: int = -1
    ) -> Plan:
        ev = await self._sign(signer, kind, tags, content, after)
        return Plan(
            action,
            {"eventId": ev["id"], "kind": kind, "createdAt": ev["created_at"]},
            events=[{"by": signer.pubkey, "event": ev}],
        )

    async def _message_post(self, ctx: Context, args: dict[str, Any]) -> Plan:
        tags = [["h", args["channelId"]], *nostr.mention_tags(args.get("mentions", ()))]
        return await self._publish_plan("message.post", ctx.signer, nostr.KIND_CHANNEL_MESSAGE, tags, args["content"])

    async def _in_channel(self, ctx: Context, event_id: str, channel: str, what: str) -> Event:
        ev = await self._fetch(ctx, event_id)
        if ev is None:
            raise ActionFailed(f"{what} event not found")
        if ev["kind"] != nostr.KIND_CHANNEL_MESSAGE or channel not in nostr.tag_values(ev, "h"):
            raise ActionFailed(f"{what} event belongs to a different channel")
        return ev

    async def _message_reply(self, ctx: Context, args: dict[str, Any]) -> Plan:
        ch = args["channelId"]
        parent = await self._in_channel(ctx, args["replyToEventId"], ch, "parent")
        root = nostr.thread_root_for_reply(parent)
        tags = nostr.reply_tags(ch, root, parent["id"]) + nostr.mention_tags(args.get("mentions", ()))
        return await self._publish_plan("message.reply", ctx.signer, nostr.KIND_CHANNEL_MESSAGE, tags, args["content"])

    async def _reaction_add(self, ctx: Context, args: dict[str, Any]) -> Plan:
        if not self.reactions_enabled:
            raise Unsupported("reactions are disabled on this host")
        ch = args["channelId"]
        target = await self._in_channel(ctx, args["targetEventId"], ch, "target")
        tags = [["e", target["id"]], ["p", target["pubkey"]], ["k", str(target["kind"])], ["h", ch]]
        return await self._publish_plan("reaction.add", ctx.signer, nostr.KIND_REACTION, tags, args["reaction"])

    async def _latest_profile(self, ctx: Context, signer: nostr.Signer) -> tuple[dict[str, Any], int]:
        events = await self.pool.connection(signer).query(
            [{"authors": [signer.pubkey], "kinds": [nostr.KIND_PROFILE], "limit": 10}], self.timeout
        )
        best = None
        for raw in events:
            ev = _checked(raw)
            if ev is not None and ev["pubkey"] == signer.pubkey and ev["kind"] == nostr.KIND_PROFILE:
                if best is None or nostr.newest_first_key(ev) < nostr.newest_first_key(best):
                    best = ev
        if best is None:
            return {}, -1
        try:
            content = json.loads(best["content"])
        except ValueError:
            content = {}
        return (content if isinstance(content, dict) else {}), int(best["created_at"])

    async def _profile_set(self, ctx: Context, args: dict[str, Any]) -> Plan:
        profile, prev = await self._latest_profile(ctx, ctx.signer)
        merged = _merge_profile(profile, args)
        return await self._publish_plan("profile.set", ctx.signer, nostr.KIND_PROFILE, [], _json(merged), prev)

    # --- storage.address

    async def _storage_address(self, ctx: Context, args: dict[str, Any]) -> Plan:
        owner = ctx.agent.owner
        if owner is None:
            raise ActionFailed("no owner is configured for this agent, so its memory has no address")
        d = nostr.d_tag(ctx.signer.conversation_key(owner), args["slug"])
        return Plan("storage.address", {"authorPubkey": ctx.agent.pubkey, "kind": contract.STORAGE_KIND, "dTag": d})

    # --- managed agents

    def _check_runtime(self, args: dict[str, Any]) -> None:
        if "runtime" in args and args["runtime"] not in self.runtimes:
            # Never the value itself: errors hold no request contents (docs/broker.md).
            raise ActionFailed("the requested runtime is not available on this host")

    async def _instance_event(
        self, owner: nostr.Signer, agent_pubkey: str, name: str, channel: str | None, settings: dict[str, Any], after: int = -1
    ) -> Event:
        public = {"name": name, "respond_to": settings.get("respondTo", "owner-only")}
        for wire, key in (("systemPrompt", "system_prompt"), ("runtime", "runtime"), ("provider", "provider"), ("model", "model")):
            if wire in settings:
                public[key] = settings[wire]
        tags = [["d", agent_pubkey], ["p", agent_pubkey]]
        if channel:
            tags.append(["h", channel])
        # strict: a later record always has a later created_at, so "newer" is decidable (superseded()).
        return await self._sign(owner, nostr.KIND_MANAGED_AGENT, tags, _json(public), after, strict=True)

    async def _agents_create(self, ctx: Context, args: dict[str, Any]) -> Plan:
        self._check_runtime(args)
        secret = nostr.generate_secret()
        agent = nostr.Signer(secret)
        sealed = self.custody.seal(secret, agent.pubkey).hex()
        # The owner (the requester) attests the new key, so relays that admit agents through their
        # owners (NIP-OA) let it in; it is sent in the agent's NIP-42 AUTH events.
        attestation = nostr.owner_attestation(ctx.signer, agent.pubkey)
        name = args["displayName"]
        settings: dict[str, Any] = {
            k: args[k] for k in ("systemPrompt", "runtime", "provider", "model", "respondTo") if k in args
        }
        settings.setdefault("respondTo", "owner-only")
        profile = await self._sign(agent, nostr.KIND_PROFILE, [], _json({"name": name, "display_name": name}))
        record = await self._instance_event(ctx.signer, agent.pubkey, name, args["channelId"], settings)
        return Plan(
            "agents.create",
            {"agentPubkey": agent.pubkey, "displayName": name, "channelId": args["channelId"]},
            events=[{"by": agent.pubkey, "event": profile}, {"by": ctx.signer.pubkey, "event": record}],
            effects=[
                {
                    "op": "create_agent",
                    "agent": {
                        "pubkey": agent.pubkey,
                        "name": name,
                        "sealed_key": sealed,
                        "owner": ctx.agent.pubkey,
                        "depth": ctx.agent.depth + 1,
                        "channel": args["channelId"],
                        "settings": settings,
                        "record_created_at": record["created_at"],
                        "attestation": attestation,
                    },
                }
            ],
            keys={agent.pubkey: sealed},
        )

    async def _target(self, ctx: Context, target: dict[str, str]) -> Agent:
        """The requester's managed agent named by C{target}, within the credential's channels.

        A managed agent belongs to the channel it was created in: a credential manages it only
        when that channel is among its own, as for every other channel-scoped action.
        """
        if "pubkey" in target:
            agent = await self.agents.agent(target["pubkey"])
            if agent is None or agent.deleted or not agent.managed:
                raise ActionFailed("no such managed agent")
            if agent.owner != ctx.agent.pubkey:
                raise Unauthorized("this agent is not owned by the requester")
        else:
            found = await self.agents.agents_named(ctx.agent.pubkey, target["name"])
            found = [a for a in found if a.managed]
            if not found:
                raise ActionFailed("no managed agent of the requester has that name")
            if len(found) > 1:
                raise ActionFailed("more than one managed agent of the requester has that name")
            agent = found[0]
        if agent.channel not in ctx.channels:
            raise Unauthorized("this session may not manage agents of that agent's channel")
        return agent

    async def _agents_update(self, ctx: Context, args: dict[str, Any]) -> Plan:
        agent = await self._target(ctx, args["target"])
        self._check_runtime(args)
        settings = dict(agent.settings)
        name = agent.name
        changed: list[str] = []
        for wire in ("displayName", "systemPrompt", "runtime", "provider", "model", "respondTo"):
            if wire not in args:
                continue
            current = name if wire == "displayName" else settings.get(wire)
            if args[wire] != current:
                changed.append(wire)
                if wire == "displayName":
                    name = args[wire]
                else:
                    settings[wire] = args[wire]
        changed.sort()
        outcome = {"agentPubkey": agent.pubkey, "displayName": name, "updatedFields": changed}
        if not changed:
            return Plan("agents.update", outcome)
        record = await self._instance_event(
            ctx.signer, agent.pubkey, name, agent.channel, settings, agent.record_created_at
        )
        events = [{"by": ctx.signer.pubkey, "event": record}]
        if "displayName" in changed:
            agent_signer = self.signer_for(agent)
            profile, prev = await self._latest_profile(ctx, agent_signer)
            profile = _merge_profile(profile, {"displayName": name})
            profile["name"] = name
            ev = await self._sign(agent_signer, nostr.KIND_PROFILE, [], _json(profile), prev)
            events.insert(0, {"by": agent.pubkey, "event": ev})
        return Plan(
            "agents.update",
            outcome,
            events=events,
            effects=[
                {
                    "op": "update_agent",
                    "pubkey": agent.pubkey,
                    "name": name,
                    "settings": settings,
                    "record_created_at": record["created_at"],
                }
            ],
        )

    async def _agents_delete(self, ctx: Context, args: dict[str, Any]) -> Plan:
        agent = await self._target(ctx, args["target"])
        # Its own managed agents would be left with no owner able to manage them: delete those first.
        if await self.agents.children(agent.pubkey):
            raise ActionFailed("this agent owns managed agents; delete them first")
        owner = ctx.signer
        tags = [["a", f"{nostr.KIND_MANAGED_AGENT}:{owner.pubkey}:{agent.pubkey}"], ["k", str(nostr.KIND_MANAGED_AGENT)]]
        ev = await self._sign(owner, nostr.KIND_DELETION, tags, "", agent.record_created_at, strict=True)
        return Plan(
            "agents.delete",
            {"agentPubkey": agent.pubkey, "displayName": agent.name},
            events=[{"by": owner.pubkey, "event": ev}],
            effects=[{"op": "delete_agent", "pubkey": agent.pubkey}],
        )


def _address(ev: Event) -> str | None:
    """The NIP-01 address of a replaceable (C{kind:pubkey:}) or addressable (C{kind:pubkey:d}) event."""
    k = ev["kind"]
    if k in (0, 3) or 10000 <= k < 20000:
        return f"{k}:{ev['pubkey']}:"
    if 30000 <= k < 40000:
        d = nostr.tag_values(ev, "d")
        return f"{k}:{ev['pubkey']}:{d[0] if d else ''}"
    return None


def evidence_filters(events: list[Event]) -> list[dict[str, Any]]:
    """The filters of one REQ that finds what the relay knows of C{events} (see L{on_relay}):
    the events themselves, NIP-09 deletions by their authors that name them (by id, or by address
    for replaceable and addressable ones), and the current event at each such address."""
    ids = [ev["id"] for ev in events]
    authors = sorted({ev["pubkey"] for ev in events})
    # No limit: one limit caps a whole REQ on some relays, and each filter matches a few events.
    filters: list[dict[str, Any]] = [
        {"ids": ids},
        {"kinds": [nostr.KIND_DELETION], "authors": authors, "#e": ids},
    ]
    addresses = sorted({a for a in map(_address, events) if a is not None})
    if addresses:
        filters.append({"kinds": [nostr.KIND_DELETION], "authors": authors, "#a": addresses})
    for address in addresses:
        k, pubkey, d = address.split(":", 2)
        current: dict[str, Any] = {"kinds": [int(k)], "authors": [pubkey]}
        if int(k) >= 30000:
            current["#d"] = [d]
        filters.append(current)
    return filters


def _overtaken(ev: Event, found: list[Event]) -> bool:
    """Whether the relay holds what it would hold had C{ev} landed and been deleted or replaced since:
    a deletion by its author naming it (by id, or its address at or after its time), or a newer
    event at its address. Whether C{ev} itself ever arrived cannot be told any more."""
    address = _address(ev)
    for other in found:
        if other["pubkey"] != ev["pubkey"] or other["id"] == ev["id"]:
            continue
        if other["kind"] == nostr.KIND_DELETION:
            if ev["id"] in nostr.tag_values(other, "e"):
                return True
            if address is not None and address in nostr.tag_values(other, "a") and other["created_at"] >= ev["created_at"]:
                return True
        elif address is not None and _address(other) == address:
            # NIP-01: the newer one is kept; in the same second, the lower id.
            if (other["created_at"], ev["id"]) > (ev["created_at"], other["id"]):
                return True
    return False


def on_relay(events: list[Event], found: list[Any], confirmed: int = 0) -> list[bool]:
    """For each event of a plan (in send order), whether it landed, from what a REQ of
    L{evidence_filters} C{found} (events that do not verify are no evidence).

    The host sends an event only after the relay accepted every earlier one of the plan, in every
    attempt. So: an event the relay holds, or one of the first C{confirmed}, landed, and so did
    every event before it. After the last such event, one deleted or replaced since (L{_overtaken})
    counts as landed: the relay holds what it would hold had it landed, and C{failed} would promise
    it never did. The first event with no such evidence did not land, and no later event was ever
    sent.
    """
    valid = [ev for ev in map(_checked, found) if ev is not None and nostr.verify_event(ev)]
    held = {ev["id"] for ev in valid}
    seen = [i for i, ev in enumerate(events) if i < confirmed or ev["id"] in held]
    last = seen[-1] if seen else -1
    landed = [i <= last for i in range(len(events))]
    for i in range(last + 1, len(events)):
        if not _overtaken(events[i], valid):
            break
        landed[i] = True
    return landed


def _merge_profile(profile: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Kind-0 merge: absent members are kept, unknown keys preserved; C{name} follows the display name."""
    merged = dict(profile)
    if "displayName" in args:
        if "name" not in merged or merged.get("name") == merged.get("display_name"):
            merged["name"] = args["displayName"]
        merged["display_name"] = args["displayName"]
    if "about" in args:
        merged["about"] = args["about"]
    if "picture" in args:
        merged["picture"] = args["picture"]
    return merged


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _checked(raw: Any) -> Event | None:
    """A relay event held to the contract's seven-member shape, or C{None} (dropped)."""
    try:
        return contract.signed_event(raw)
    except contract.ContractError:
        return None
