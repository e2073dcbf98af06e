"""Scrape a Prometheus text endpoint into {(name, labels): value} for assertions."""

from __future__ import annotations

from typing import Any, Mapping

import treq
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor
from twisted.web.client import HTTPConnectionPool

TIMEOUT = 5.0
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by name and sorted label pairs."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def scrape(url: str, pool: HTTPConnectionPool | None = None) -> tuple[Samples, Any]:
    """GET C{url}; returns the parsed samples (none unless 200) and the response."""
    pool = pool or HTTPConnectionPool(reactor, persistent=False)
    d = treq.get(url, pool=pool)
    d.addTimeout(TIMEOUT, reactor)
    response = await d
    body = await treq.content(response)
    return (parse(body.decode("utf-8")) if response.code == 200 else {}), response


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much one sample grew between two scrapes."""
    return value(after, name, **labels) - value(before, name, **labels)


def names(samples: Mapping[tuple[str, Any], float]) -> set[str]:
    return {name for name, _ in samples}
