"""The stores' plumbing: the Redis client (single primary, Sentinel, Cluster), Lua script loading and
SQLite schema upgrades. Below the wing contract; imports only relayd.base and the fence (relayd.compat)."""
