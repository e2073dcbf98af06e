-- Receipts per principal, kept by triggers in the transaction that inserts or deletes one, so the
-- per-agent cap (--broker-max-receipts) costs one indexed read per write (counting rows would walk
-- the principal's receipts). The counts start from the receipts present.
CREATE INDEX IF NOT EXISTS receipts_principal_created ON receipts(principal, created_at);
CREATE TABLE receipt_counts (principal TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO receipt_counts SELECT principal, COUNT(*) FROM receipts GROUP BY principal;
CREATE TRIGGER receipts_counted AFTER INSERT ON receipts BEGIN
    INSERT INTO receipt_counts VALUES (new.principal, 1) ON CONFLICT (principal) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER receipts_uncounted AFTER DELETE ON receipts BEGIN
    UPDATE receipt_counts SET n = n - 1 WHERE principal = old.principal;
    DELETE FROM receipt_counts WHERE principal = old.principal AND n <= 0;
END;
