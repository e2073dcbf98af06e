"""The local effects of an execution: agents created, updated, deleted, as typed values.

An action's plan (L{relayd.buzz.core.operations.Plan}) carries the effects to apply once the relay has
accepted its events; the plan is stored before anything is sent, so effects have a stored form, a
JSON object named by its C{"op"}: C{{"op": "create_agent", "agent": {...}}},
C{{"op": "update_agent", "pubkey", "name", "settings", "record_created_at"}},
C{{"op": "delete_agent", "pubkey"}}. That form is what every plan stored so far holds, so it stays
the stored form: L{parse} reads it (an unknown C{op} is refused), L{Effect.stored} writes it.

The stores take either form (L{EffectLike}) and interpret only the typed one
(L{relayd.buzz.core.state.sqlite}), dispatching on its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping


@dataclass(frozen=True)
class CreateAgent:
    """A managed agent minted by C{agents.create}: never re-created over itself, never revived."""

    pubkey: str
    name: str
    sealed_key: bytes
    owner: str
    depth: int
    channel: str | None
    settings: Mapping[str, Any]
    record_created_at: int
    attestation: tuple[str, ...] | None = None

    def stored(self) -> dict[str, Any]:
        agent: dict[str, Any] = {
            "pubkey": self.pubkey,
            "name": self.name,
            "sealed_key": self.sealed_key.hex(),
            "owner": self.owner,
            "depth": self.depth,
            "channel": self.channel,
            "settings": dict(self.settings),
            "record_created_at": self.record_created_at,
        }
        if self.attestation:
            agent["attestation"] = list(self.attestation)
        return {"op": "create_agent", "agent": agent}


@dataclass(frozen=True)
class UpdateAgent:
    """A new name and settings, landing only on a live agent whose record is not newer."""

    pubkey: str
    name: str
    settings: Mapping[str, Any]
    record_created_at: int

    def stored(self) -> dict[str, Any]:
        return {
            "op": "update_agent",
            "pubkey": self.pubkey,
            "name": self.name,
            "settings": dict(self.settings),
            "record_created_at": self.record_created_at,
        }


@dataclass(frozen=True)
class DeleteAgent:
    """An agent deleted: its key destroyed, the credentials bound to it revoked."""

    pubkey: str

    def stored(self) -> dict[str, Any]:
        return {"op": "delete_agent", "pubkey": self.pubkey}


Effect = CreateAgent | UpdateAgent | DeleteAgent
EffectLike = Effect | Mapping[str, Any]
"""A typed effect, or its stored form (what plans hold and build)."""


class UnknownEffect(ValueError):
    """A stored effect whose C{op} this relayd does not know."""


def parse(stored: EffectLike) -> Effect:
    """The typed effect of C{stored} (a typed one is returned as it is)."""
    if isinstance(stored, (CreateAgent, UpdateAgent, DeleteAgent)):
        return stored
    op = stored.get("op")
    if op == "create_agent":
        a = stored["agent"]
        attestation = a.get("attestation")
        return CreateAgent(
            pubkey=a["pubkey"],
            name=a["name"],
            sealed_key=bytes.fromhex(a["sealed_key"]),
            owner=a["owner"],
            depth=a["depth"],
            channel=a["channel"],
            settings=a["settings"],
            record_created_at=a["record_created_at"],
            attestation=tuple(attestation) if attestation else None,
        )
    if op == "update_agent":
        return UpdateAgent(stored["pubkey"], stored["name"], stored["settings"], stored["record_created_at"])
    if op == "delete_agent":
        return DeleteAgent(stored["pubkey"])
    raise UnknownEffect(f"unknown effect {op!r}")


def parse_all(stored: Iterable[EffectLike]) -> list[Effect]:
    """Every effect of C{stored}, typed, in order."""
    return [parse(effect) for effect in stored]


def destroys_keys(effects: Iterable[Effect]) -> bool:
    """Whether applying C{effects} destroys a sealed key (the WAL is scrubbed after)."""
    return any(isinstance(effect, DeleteAgent) for effect in effects)
