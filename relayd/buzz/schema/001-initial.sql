-- The broker's state as relayd wrote it before versioned schemas (docs/deployment.md "Upgrades"),
-- before the receipt counts (002).
-- IF NOT EXISTS: adopting an unversioned database runs this too, creating only what it lacks.
CREATE TABLE IF NOT EXISTS credentials (
    hash TEXT PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    agent_pubkey TEXT NOT NULL,
    channels TEXT NOT NULL,
    actions TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER,
    expires_at INTEGER  -- unix time after which the credential is refused
);
CREATE INDEX IF NOT EXISTS credentials_agent ON credentials(agent_pubkey);
CREATE TABLE IF NOT EXISTS agents (
    pubkey TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    sealed_key BLOB,
    owner TEXT,
    managed INTEGER NOT NULL DEFAULT 0,
    depth INTEGER NOT NULL DEFAULT 0,
    channel TEXT,
    settings TEXT NOT NULL DEFAULT '{}',
    record_created_at INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    deleted_at INTEGER,
    attestation TEXT  -- the owner's NIP-OA tag (JSON) for a managed agent
);
CREATE INDEX IF NOT EXISTS agents_owner_name ON agents(owner, name);
CREATE TABLE IF NOT EXISTS receipts (
    principal TEXT NOT NULL,
    request_id TEXT NOT NULL,
    digest BLOB NOT NULL,
    state TEXT NOT NULL,
    response BLOB,
    plan BLOB,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (principal, request_id)
);
CREATE INDEX IF NOT EXISTS receipts_created ON receipts(created_at);
CREATE TABLE IF NOT EXISTS clocks (
    pubkey TEXT PRIMARY KEY,
    second INTEGER NOT NULL,
    digests BLOB NOT NULL
);
