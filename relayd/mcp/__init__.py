"""The MCP tunnel relay wing: an SSE+POST (and long-poll) tunnel between a browser page and agents."""
