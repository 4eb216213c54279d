-- What a new leader must know of its predecessor to start safely: whether
-- the predecessor held the election's guard, on which server incarnation
-- its term began, whether it ended cleanly, and how long it may take to
-- notice a loss.
ALTER TABLE leaders ADD COLUMN guarded boolean NOT NULL DEFAULT true;
ALTER TABLE leaders ADD COLUMN server_start timestamptz;
ALTER TABLE leaders ADD COLUMN ended boolean NOT NULL DEFAULT false;
ALTER TABLE leaders ADD COLUMN loss_deadline_ms bigint;
ALTER TABLE leaders ADD COLUMN not_before timestamptz;

COMMENT ON COLUMN leaders.guarded IS
    'false while the leader leads without the election''s guard (its predecessor did not free the guard within the loss deadline): its successor then waits the loss deadline after winning before it starts.';
COMMENT ON COLUMN leaders.server_start IS
    'pg_postmaster_start_time() of the server on which the term began. A successor on a server started since then (a restart or a failover ended the term) waits the loss deadline after winning before it starts.';
COMMENT ON COLUMN leaders.ended IS
    'true once the leader ended its term itself (resigned, or its Client closed) after its context was cancelled: its successor need not wait.';
COMMENT ON COLUMN leaders.loss_deadline_ms IS
    'The longest loss deadline (WithLossDeadline), in milliseconds, among the leaders since the last term that ended cleanly: a leader among them that lost its lock notices it at most this long after the loss. A successor that must wait for them waits this long after winning.';
COMMENT ON COLUMN leaders.not_before IS
    'The time before which the leader of this term does not start, because a predecessor may live on without knowing it lost; a successor that wins before it, should this leader give up, waits until then too.';
