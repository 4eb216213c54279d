DROP FUNCTION semaphore_await(text, bigint, text, integer, text);
