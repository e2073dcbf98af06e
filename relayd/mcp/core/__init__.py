"""The MCP wing's core: what it knows without HTTP (it imports no transport; pyproject.toml's contract)."""
