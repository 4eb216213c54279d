-- Placeholder that keeps the migration numbers without a gap: version 2 is
-- leader election's. It creates nothing; the leader election migration of
-- the same name replaces it.
SELECT 1;
