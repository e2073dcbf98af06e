"""Hostile input against a real relayd: see tests/hostile/harness.py for the invariants."""
