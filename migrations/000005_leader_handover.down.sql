ALTER TABLE leaders DROP COLUMN not_before;
ALTER TABLE leaders DROP COLUMN loss_deadline_ms;
ALTER TABLE leaders DROP COLUMN ended;
ALTER TABLE leaders DROP COLUMN server_start;
ALTER TABLE leaders DROP COLUMN guarded;
