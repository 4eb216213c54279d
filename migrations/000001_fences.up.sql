-- Fencing tokens: one row per advisory lock key that has ever been taken with
-- a fence. Names are not schema-qualified: the table is created in the first
-- schema of search_path (pgcoord.Migrate sets it to the configured schema).
CREATE TABLE fences (
    key_space smallint NOT NULL CHECK (key_space IN (1, 2)),
    key       bigint   NOT NULL,
    fence     bigint   NOT NULL CHECK (fence > 0),
    PRIMARY KEY (key_space, key)
);

COMMENT ON TABLE fences IS
    'pgcoord fencing tokens: the last fence issued for each advisory lock key. A writer calls CheckFence in its transaction, which share-locks the row, so no newer fence can be issued until that transaction ends.';
COMMENT ON COLUMN fences.key_space IS
    'Advisory lock key space, as objsubid in pg_locks: 1 for a bigint key (Int64Key, HashKey), 2 for a pair of int4 (PairKey).';
COMMENT ON COLUMN fences.key IS
    'Key value as in pg_locks: (classid::bigint << 32) | objid::bigint. For a bigint key that is the key itself; for a pair key (a, b) it is (a << 32) | (b & 4294967295).';
COMMENT ON COLUMN fences.fence IS
    'Last fence issued for the key. Fences start at 1 and only grow; every holder that takes the lock with a fence gets the next one.';
