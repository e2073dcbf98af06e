"""The fence's prometheus_client entry (relayd/compat/prometheus.py): L{adder} counts exactly as
C{inc} does and L{recorder} records exactly as C{observe} does, each detected on the installed release,
and each falls back to the metric's own call where it cannot reach."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from twisted.trial.unittest import TestCase

from relayd.compat import prometheus as fence
from relayd.compat.prometheus import DIRECT_HISTOGRAMS, DIRECT_VALUES, adder, recorder


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

    def test_adds_a_count_as_inc_does(self) -> None:
        """An adder given a count adds it, as C{inc(count)} does (a batch's events counted at once)."""
        counted_registry, counted, increased_registry, increased = _counters()
        add = adder(counted.labels(relay="aep", code="202"))
        add(100)
        add()
        increased.labels(relay="aep", code="202").inc(100)
        increased.labels(relay="aep", code="202").inc()
        samples = _samples(counted_registry)
        self.assertIn('relayd_test_answers_total{code="202",relay="aep"} 101.0', samples)
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


def _histograms() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, Histogram]:
    """Two registries, each with the same labelled histogram."""
    registries = CollectorRegistry(), CollectorRegistry()
    recorded, observed = (
        Histogram("relayd_test_seconds", "s", ["relay"], buckets=(0.001, 0.01, 0.1), registry=r) for r in registries
    )
    return registries[0], recorded, registries[1], observed


class Recorder(TestCase):
    def test_detected_on_the_installed_release(self) -> None:
        """prometheus_client's histograms still hold MutexValues, sum and buckets (else it is C{observe})."""
        self.assertTrue(DIRECT_HISTOGRAMS)
        _, recorded, _, _ = _histograms()
        self.assertNotEqual(recorder(recorded.labels(relay="aep")).__name__, "observe")

    def test_records_as_observe_does(self) -> None:
        """Amounts below, at, between and above the bounds, zero, negative and infinite land in the same
        buckets and sum as C{observe} puts them."""
        recorded_registry, recorded, observed_registry, observed = _histograms()
        record = recorder(recorded.labels(relay="aep"))
        amounts = (0.0, -1.0, 0.0005, 0.001, 0.0010001, 0.01, 0.05, 0.1, 0.2, 7.0, float("inf"))
        for amount in amounts:
            record(amount)
            observed.labels(relay="aep").observe(amount)
        samples = _samples(recorded_registry)
        self.assertIn('relayd_test_seconds_bucket{le="0.001",relay="aep"} 4.0', samples)
        self.assertIn('relayd_test_seconds_bucket{le="0.01",relay="aep"} 6.0', samples)
        self.assertIn('relayd_test_seconds_bucket{le="0.1",relay="aep"} 8.0', samples)
        self.assertIn('relayd_test_seconds_count{relay="aep"} 11.0', samples)
        self.assertEqual(samples, _samples(observed_registry))

    def test_falls_back_to_observe(self) -> None:
        """Where the values are not reachable, the recorder is the histogram's own C{observe}, and records."""
        self.patch(fence, "DIRECT_HISTOGRAMS", False)
        registry, recorded, _, _ = _histograms()
        child = recorded.labels(relay="aep")
        record = recorder(child)
        self.assertEqual(record, child.observe)
        record(0.05)
        self.assertIn('relayd_test_seconds_bucket{le="0.1",relay="aep"} 1.0', _samples(registry))

    def test_a_histogram_with_unset_labels_refuses_as_observe_does(self) -> None:
        """A labelled histogram's parent cannot record: its recorder raises C{observe}'s error."""
        _, recorded, _, _ = _histograms()
        self.assertRaises(ValueError, recorder(recorded), 0.05)
