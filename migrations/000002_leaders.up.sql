-- Leader elections: one row per election that has ever had a leader. The
-- row says who leads; the election's advisory lock says whether that leader
-- is alive. A row whose pid does not hold the election's lock is a past
-- leader, not a current one.
CREATE TABLE leaders (
    name     text        PRIMARY KEY,
    lock_key bigint      NOT NULL,
    identity text        NOT NULL,
    term     bigint      NOT NULL CHECK (term > 0),
    since    timestamptz NOT NULL,
    pid      integer     NOT NULL
);

COMMENT ON TABLE leaders IS
    'pgcoord leader elections: the latest leader of each election. The leader is alive only while backend pid holds the advisory lock lock_key (pg_locks: classid = lock_key >> 32, objid = lock_key & 4294967295, objsubid = 1).';
COMMENT ON COLUMN leaders.term IS
    'Term of the leader: the fence of the election''s lock key in the fences table. Terms only grow; pass them to CheckFence with the election''s key.';
COMMENT ON COLUMN leaders.pid IS
    'Backend that holds the election''s lock for this leader; pg_terminate_backend(pid) forces a new election.';
