-- semaphore_await: the head of a semaphore's queue waits on the server for
-- slot 0, as a lock waiter waits for its key, and takes the permit in the
-- same statement once the slot is granted: the release of the permit wakes
-- it with no notification and no further round trip. pgcoord uses it for
-- semaphores of limit 1, whose only slot is slot 0; with more slots no one
-- slot is the one to wait for, and the head is woken by notification.
--
-- It waits for slot 0 at most p_lock_timeout (then it fails with SQLSTATE
-- 55P03 and holds nothing). Once the slot is granted it checks, under the
-- semaphore's row lock, that the permits held, its own included, are within
-- the limit (by the rows of the other slots, and if there are any, by
-- pg_locks as semaphore_acquire does; a slot key taken by hand, outside
-- these functions, is not a permit): then it writes the holder's row,
-- releases the queue key (the caller is the head and holds it) and returns
-- the slot; otherwise (the limit was lowered while other slots are held)
-- it releases the slot and returns a NULL slot. While another slot is
-- granted (a lowered limit) it does not wait, and returns a NULL slot at
-- once: the head is then woken by notification. Like semaphore_acquire it
-- does nothing on a backend other than p_pid. If it fails after the slot
-- was granted (a row lock waited for longer than p_lock_timeout, say), the
-- slot stays held by the session: the caller releases it.
CREATE FUNCTION semaphore_await(p_name text, p_key bigint, p_identity text, p_pid integer,
        p_lock_timeout text)
    RETURNS TABLE (slot integer, sem_limit integer, holders integer)
    LANGUAGE plpgsql
    SET search_path FROM CURRENT
AS $$
DECLARE
    v_prefix bigint := p_key >> 16;
    v_held   integer[];
BEGIN
    IF pg_catalog.pg_backend_pid() <> p_pid THEN
        RETURN;
    END IF;
    PERFORM pg_catalog.set_config('synchronous_commit', 'off', true),
            pg_catalog.set_config('lock_timeout', p_lock_timeout, true);
    -- Another slot granted (a lowered limit): slot 0 may be free while the
    -- semaphore is full, and taking it even for a moment would show more
    -- permits than the limit in pg_locks. Leave it to notifications.
    IF EXISTS (SELECT FROM pg_catalog.pg_locks pl
                WHERE pl.locktype = 'advisory' AND pl.objsubid = 1 AND pl.granted
                  AND pl.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                      WHERE d.datname = pg_catalog.current_database())
                  AND ((pl.classid::bigint << 32) | pl.objid::bigint) >> 16 = v_prefix
                  AND ((pl.classid::bigint << 32) | pl.objid::bigint) & 65535 NOT IN (0, 65535)) THEN
        RETURN NEXT;
        RETURN;
    END IF;
    PERFORM pg_catalog.pg_advisory_lock(v_prefix << 16);

    SELECT s."limit" INTO sem_limit FROM semaphores s WHERE s.name = p_name FOR UPDATE;
    -- Every permit that semaphore_acquire or semaphore_await grants has
    -- its row, committed with the grant and before the semaphore's row
    -- lock is released, and a row goes only after its slot is free. With
    -- no row of another slot, slot 0 is the only permit: no need to read
    -- pg_locks, whose cost grows with the server's lock table.
    IF sem_limit IS NOT NULL AND NOT EXISTS (
            SELECT FROM semaphore_holders h WHERE h.name = p_name AND h.slot <> 0) THEN
        INSERT INTO semaphore_holders AS h (name, slot, lock_key, pid, identity, since)
            VALUES (p_name, 0, v_prefix << 16, pg_catalog.pg_backend_pid(), p_identity, now())
            ON CONFLICT ON CONSTRAINT semaphore_holders_pkey DO UPDATE
            SET lock_key = excluded.lock_key, pid = excluded.pid, identity = excluded.identity, since = excluded.since;
        PERFORM pg_catalog.pg_advisory_unlock((v_prefix << 16) | 65535);
        slot := 0;
        holders := 1;
        RETURN NEXT;
        RETURN;
    END IF;

    -- Rows of other slots: count the permits in pg_locks, as
    -- semaphore_acquire does.
    SELECT coalesce(array_agg((l.k & 65535)::integer) FILTER (WHERE l.granted AND l.k & 65535 <> 65535), '{}')
      INTO v_held
      FROM (SELECT (pl.classid::bigint << 32) | pl.objid::bigint AS k, pl.granted
              FROM pg_catalog.pg_locks pl
             WHERE pl.locktype = 'advisory' AND pl.objsubid = 1
               AND pl.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                   WHERE d.datname = pg_catalog.current_database())) l
     WHERE l.k >> 16 = v_prefix;
    holders := cardinality(v_held);
    IF sem_limit IS NULL OR holders > sem_limit THEN
        PERFORM pg_catalog.pg_advisory_unlock(v_prefix << 16);
        holders := holders - 1;
        RETURN NEXT;
        RETURN;
    END IF;

    -- Rows of free slots were left by holders that died.
    DELETE FROM semaphore_holders h WHERE h.name = p_name AND h.slot <> ALL (v_held);
    INSERT INTO semaphore_holders AS h (name, slot, lock_key, pid, identity, since)
        VALUES (p_name, 0, v_prefix << 16, pg_catalog.pg_backend_pid(), p_identity, now())
        ON CONFLICT ON CONSTRAINT semaphore_holders_pkey DO UPDATE
        SET lock_key = excluded.lock_key, pid = excluded.pid, identity = excluded.identity, since = excluded.since;
    PERFORM pg_catalog.pg_advisory_unlock((v_prefix << 16) | 65535);
    slot := 0;
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION semaphore_await(text, bigint, text, integer, text) IS
    'pgcoord: the head of a semaphore''s queue waits for slot 0 and takes the permit (see the file that created it).';
