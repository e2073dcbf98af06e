"""The bottom layer: the clock, the reactor protocol, the settings framework, coroutine helpers, the JSON
codec, the metrics registry and the errors every store raises. Stdlib and Twisted's public API only: it
imports nothing of relayd's above it (pyproject.toml's C{layers} contract)."""
