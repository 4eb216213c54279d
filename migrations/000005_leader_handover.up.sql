-- What a new leader must know of its predecessor to start safely: whether
-- the predecessor held the election's guard, on which server incarnation
-- its term began, whether it ended cleanly, and how long it may take to
-- notice a loss.
ALTER TABLE leaders ADD COLUMN guarded boolean NOT NULL DEFAULT true;
ALTER TABLE leaders ADD COLUMN server_start timestamptz;
ALTER TABLE leaders ADD COLUMN ended boolean NOT NULL DEFAULT false;
ALTER TABLE leaders ADD COLUMN loss_deadline_ms bigint;

COMMENT ON COLUMN leaders.guarded IS
    'false while the leader leads without the election''s guard (its predecessor did not free the guard within the loss deadline): its successor then waits the loss deadline after winning before it starts.';
COMMENT ON COLUMN leaders.server_start IS
    'pg_postmaster_start_time() of the server on which the term began. A successor on a server started since then (a restart or a failover ended the term) waits the loss deadline after winning before it starts.';
COMMENT ON COLUMN leaders.ended IS
    'true once the leader ended its term itself (resigned, or its Client closed) after its context was cancelled: its successor need not wait.';
COMMENT ON COLUMN leaders.loss_deadline_ms IS
    'The leader''s loss deadline (WithLossDeadline) in milliseconds: it notices the loss of its lock at most this long after the loss. A successor that must wait for it waits at least this long.';
