"""Test clients and harnesses shared by every wing's tests (real sockets, real protocols)."""
