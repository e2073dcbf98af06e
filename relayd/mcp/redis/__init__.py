"""The MCP wing's state and messages on Redis (--redis): the store and the bus the core is given."""
