-- Semaphores: the limit of each semaphore and a row per holder. Names are not
-- qualified: the tables and functions are created in the first schema of
-- search_path (pgcoord.Migrate sets it to the configured one), and the
-- functions keep that search_path (SET search_path FROM CURRENT).
--
-- A permit is a session-level advisory lock on a slot key. Every advisory
-- lock of a semaphore shares the upper 48 bits of its lock_key: slot s is
-- (lock_key >> 16 << 16) | s for s in [0, 65535), and the key with the low
-- 16 bits all set is its queue, on which waiters line up. The locks are the
-- truth: a permit is held exactly while its slot key is granted in pg_locks,
-- so a holder whose backend died holds nothing, whatever its row says.
CREATE TABLE semaphores (
    name       text        PRIMARY KEY CHECK (octet_length(name) BETWEEN 1 AND 1024),
    "limit"    integer     NOT NULL CHECK ("limit" BETWEEN 1 AND 65535),
    lock_key   bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE semaphores IS
    'pgcoord semaphores: at most "limit" processes hold a permit of a semaphore at once. The first acquire creates the row; change "limit" with UPDATE (or Semaphore.SetLimit): waiters are notified, and holders beyond a lower limit keep their permits.';
COMMENT ON COLUMN semaphores."limit" IS
    'How many permits may be held at once, 1 to 65535. Lowering it takes no permit away; no new permit is granted until fewer than "limit" are held.';
COMMENT ON COLUMN semaphores.lock_key IS
    'Advisory lock key of the semaphore, derived from its name by the client. Its locks in pg_locks are those with objsubid = 1 and ((classid::bigint << 32) | objid::bigint) >> 16 = lock_key >> 16: low 16 bits 0 to 65534 are permits (slots), 65535 is the queue of waiters.';

CREATE TABLE semaphore_holders (
    name     text        NOT NULL,
    slot     integer     NOT NULL CHECK (slot BETWEEN 0 AND 65534),
    lock_key bigint      NOT NULL,
    pid      integer     NOT NULL,
    identity text        NOT NULL,
    since    timestamptz NOT NULL,
    PRIMARY KEY (name, slot)
);

COMMENT ON TABLE semaphore_holders IS
    'pgcoord semaphore holders, for people and Semaphore.Holders: who took each permit and when. A row counts only while backend pid holds lock_key in pg_locks; rows left by holders that died are ignored and removed by later acquires.';
COMMENT ON COLUMN semaphore_holders.lock_key IS
    'Advisory lock key of the permit''s slot, as in pg_locks: (classid::bigint << 32) | objid::bigint with objsubid = 1.';
COMMENT ON COLUMN semaphore_holders.pid IS
    'Backend holding the permit: pg_terminate_backend(pid) frees it, and every other lock of that backend.';

-- semaphore_acquire grants one permit of semaphore p_name, if one is free, to
-- the calling backend, which must be p_pid (on any other backend, behind a
-- pooler that moved the statement, it does nothing and returns no row), and
-- returns its slot (NULL if none was granted), the
-- limit, the number of permits held including the new one, and whether the
-- permit was refused because others wait in the queue (only the head of the
-- queue, p_head, may take a permit while anyone waits; the head holds the queue
-- key on the calling backend, and a grant to it releases that key, so the next
-- waiter heads the queue). The row lock on the semaphore serialises grants and
-- limit changes, so counting the permits in pg_locks and taking a free slot is
-- one step. The slot's lock is taken last (then the queue key released):
-- nothing in the function can fail after it.
CREATE FUNCTION semaphore_acquire(p_name text, p_limit integer, p_key bigint, p_head boolean,
        p_identity text, p_lock_timeout text, p_pid integer)
    RETURNS TABLE (slot integer, sem_limit integer, holders integer, queued boolean)
    LANGUAGE plpgsql
    SET search_path FROM CURRENT
AS $$
DECLARE
    v_prefix bigint := p_key >> 16;
    v_held   integer[];
    v_queue  boolean;
    v_slot   integer;
BEGIN
    IF pg_catalog.pg_backend_pid() <> p_pid THEN
        RETURN;
    END IF;
    -- A lost row loses nothing (the locks are the truth), so the commit
    -- need not wait for the disk; a row lock held elsewhere is waited for
    -- at most p_lock_timeout.
    PERFORM pg_catalog.set_config('synchronous_commit', 'off', true),
            pg_catalog.set_config('lock_timeout', p_lock_timeout, true);
    SELECT s."limit" INTO sem_limit FROM semaphores s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO semaphores AS s (name, "limit", lock_key) VALUES (p_name, p_limit, p_key)
            ON CONFLICT (name) DO NOTHING;
        SELECT s."limit" INTO sem_limit FROM semaphores s WHERE s.name = p_name FOR UPDATE;
    END IF;

    SELECT coalesce(array_agg((l.k & 65535)::integer) FILTER (WHERE l.granted AND l.k & 65535 <> 65535), '{}'),
           coalesce(bool_or(l.k & 65535 = 65535), false)
      INTO v_held, v_queue
      FROM (SELECT (pl.classid::bigint << 32) | pl.objid::bigint AS k, pl.granted
              FROM pg_catalog.pg_locks pl
             WHERE pl.locktype = 'advisory' AND pl.objsubid = 1
               AND pl.database = (SELECT d.oid FROM pg_catalog.pg_database d
                                   WHERE d.datname = pg_catalog.current_database())) l
     WHERE l.k >> 16 = v_prefix;
    holders := cardinality(v_held);
    queued := v_queue AND NOT p_head;
    IF queued OR holders >= sem_limit THEN
        RETURN NEXT;
        RETURN;
    END IF;

    -- Rows of free slots were left by holders that died.
    DELETE FROM semaphore_holders h WHERE h.name = p_name AND h.slot <> ALL (v_held);
    FOR v_slot IN 0 .. sem_limit - 1 LOOP
        CONTINUE WHEN v_slot = ANY (v_held);
        INSERT INTO semaphore_holders AS h (name, slot, lock_key, pid, identity, since)
            VALUES (p_name, v_slot, (v_prefix << 16) | v_slot, pg_catalog.pg_backend_pid(), p_identity, now())
            ON CONFLICT ON CONSTRAINT semaphore_holders_pkey DO UPDATE
            SET lock_key = excluded.lock_key, pid = excluded.pid, identity = excluded.identity, since = excluded.since;
        IF pg_catalog.pg_try_advisory_lock((v_prefix << 16) | v_slot) THEN
            IF p_head THEN
                PERFORM pg_catalog.pg_advisory_unlock((v_prefix << 16) | 65535);
            END IF;
            slot := v_slot;
            holders := holders + 1;
            RETURN NEXT;
            RETURN;
        END IF;
        -- Held outside semaphore_acquire (by hand, say): not a slot to use.
        DELETE FROM semaphore_holders h WHERE h.name = p_name AND h.slot = v_slot;
    END LOOP;
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION semaphore_acquire(text, integer, bigint, boolean, text, text, integer) IS
    'pgcoord: grants a permit of a semaphore to the calling backend if one is free (see the file that created it).';

-- A change of a limit wakes the waiters of the semaphore, which re-read it.
CREATE FUNCTION semaphore_limit_changed() RETURNS trigger
    LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_catalog.pg_notify('pgcoord_semaphore', NEW.lock_key::text || ':limit');
    RETURN NULL;
END
$$;

CREATE TRIGGER semaphore_limit_changed
    AFTER UPDATE OF "limit" ON semaphores
    FOR EACH ROW WHEN (NEW."limit" IS DISTINCT FROM OLD."limit")
    EXECUTE FUNCTION semaphore_limit_changed();
