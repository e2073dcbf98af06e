"""The fence's prometheus_client entry (relayd/compat/prometheus.py): L{adder} counts exactly as
C{inc} does, detected on the installed release, and falls back to C{inc} where it cannot reach."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from twisted.trial.unittest import TestCase

from relayd.compat import prometheus as fence
from relayd.compat.prometheus import DIRECT_VALUES, adder


def _counters() -> tuple[CollectorRegistry, Counter, CollectorRegistry, Counter]:
    """Two registries, each with the same labelled counter."""
    registries = CollectorRegistry(), CollectorRegistry()
    counted, increased = (Counter("relayd_test_answers", "answers", ["relay", "code"], registry=r) for r in registries)
    return registries[0], counted, registries[1], increased


def _samples(registry: CollectorRegistry) -> list[str]:
    """The exposition's sample lines (the C{_created} stamps differ between two counters)."""
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


class Adder(TestCase):
    def test_detected_on_the_installed_release(self) -> None:
        """prometheus_client's counters still hold a MutexValue's C{_value} (else every adder is C{inc})."""
        self.assertTrue(DIRECT_VALUES)
        self.assertNotEqual(adder(Counter("relayd_test_direct", "d", registry=CollectorRegistry())).__name__, "inc")

    def test_counts_as_inc_does(self) -> None:
        """Three calls of an adder of a labelled child and three C{inc}s expose the same samples."""
        counted_registry, counted, increased_registry, increased = _counters()
        add = adder(counted.labels(relay="mcp", code="200"))
        for _ in range(3):
            add()
            increased.labels(relay="mcp", code="200").inc()
        samples = _samples(counted_registry)
        self.assertIn('relayd_test_answers_total{code="200",relay="mcp"} 3.0', samples)
        self.assertEqual(samples, _samples(increased_registry))

    def test_falls_back_to_inc(self) -> None:
        """Where the value is not reachable, the adder is the counter's own C{inc}, and counts."""
        self.patch(fence, "DIRECT_VALUES", False)
        registry, counted, _, _ = _counters()
        child = counted.labels(relay="mcp", code="202")
        add = adder(child)
        self.assertEqual(add, child.inc)
        add()
        self.assertIn('relayd_test_answers_total{code="202",relay="mcp"} 1.0', _samples(registry))

    def test_a_counter_with_unset_labels_refuses_as_inc_does(self) -> None:
        """A labelled counter's parent cannot be counted: its adder raises C{inc}'s error."""
        _, counted, _, _ = _counters()
        self.assertRaises(ValueError, adder(counted))
