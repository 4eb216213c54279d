DROP TRIGGER semaphore_limit_changed ON semaphores;
DROP FUNCTION semaphore_limit_changed();
DROP FUNCTION semaphore_acquire(text, integer, bigint, boolean, text, text, integer);
DROP TABLE semaphore_holders;
DROP TABLE semaphores;
