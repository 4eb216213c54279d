-- Placeholder: see 000002_leaders.up.sql.
SELECT 1;
