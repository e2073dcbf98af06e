"""relayd: a Twisted relay for AI agents (AEP relay, MCP tunnel relay, Buzz broker host)."""

__version__ = "0.1.0"
