package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
)

// state is what "pgcoord locks" and "pgcoord ui" show: the advisory locks
// of the database with the names of their keys, who waits for whom, and
// pgcoord's elections and semaphores in one schema. readState reads it
// with a fixed set of statements, whatever it finds.
type state struct {
	Time       time.Time       `json:"time"`
	Schema     string          `json:"schema"`
	Migrated   bool            `json:"migrated"` // the schema has pgcoord's tables
	Locks      []lockRow       `json:"locks"`
	Waits      []waitEdge      `json:"waits"`
	Elections  []electionRow   `json:"elections"`
	Semaphores []semaphoreInfo `json:"semaphores"`
}

// keyName says what a key is: a name given by the user, or one of
// pgcoord's own keys found in the schema's tables.
type keyName struct {
	Name   string `json:"name"`             // what the operator reads
	Kind   string `json:"kind"`             // see the kind* constants
	Object string `json:"object,omitempty"` // the election's or semaphore's name
	Slot   *int   `json:"slot,omitempty"`   // a semaphore's slot
}

// The kinds of a key.
const (
	kindUser          = "user"           // a name from --name, --names-file or the demo
	kindElection      = "election"       // an election's lock: whoever holds it leads
	kindElectionGuard = "election_guard" // the guard a leader keeps until it has stepped down
	kindSemaphoreSlot = "semaphore_slot" // a permit of a semaphore
	kindSemaphoreQ    = "semaphore_queue"
	kindMigrate       = "migrate" // the lock that serialises migrations
)

// lockRow is one row of pg_locks for an advisory lock: a backend that
// holds a key or waits for it.
type lockRow struct {
	Key pgcoord.Key `json:"key"`
	keyName
	Fence           int64      `json:"fence,omitempty"` // the last fence issued for the key, if any
	Mode            string     `json:"mode"`
	Granted         bool       `json:"granted"`
	PID             int32      `json:"pid"`
	ApplicationName string     `json:"application_name"`
	ClientAddr      string     `json:"client_addr"`
	Since           *time.Time `json:"since,omitempty"`
	BlockedBy       []int32    `json:"blocked_by,omitempty"` // pg_blocking_pids of a waiter
}

// label is the row's name, or its key when it has none.
func (l *lockRow) label() string {
	if l.Name != "" {
		return l.Name
	}
	return l.Key.String()
}

// waitEdge says that backend Waiter waits for a lock that backend Blocker
// holds, or waits for ahead of it (pg_blocking_pids).
type waitEdge struct {
	Waiter  int32 `json:"waiter"`
	Blocker int32 `json:"blocker"`
}

// electionRow is one election: its latest leader, whether that leader
// still holds the election's lock, and the backends waiting for it.
type electionRow struct {
	Name       string      `json:"name"`
	Identity   string      `json:"identity"` // of the latest leader
	Term       int64       `json:"term"`
	Since      time.Time   `json:"since"`
	PID        int32       `json:"pid"`
	Leading    bool        `json:"leading"` // PID still holds the election's lock
	Candidates []candidate `json:"candidates"`
}

// candidate is a backend that waits for an election's lock or a
// semaphore's queue.
type candidate struct {
	PID             int32      `json:"pid"`
	ApplicationName string     `json:"application_name"`
	Since           *time.Time `json:"since,omitempty"`
	Head            bool       `json:"head,omitempty"` // holds a semaphore's queue key: next in line
}

// semaphoreInfo is one semaphore: its limit, its live holders and the
// backends queued for a permit.
type semaphoreInfo struct {
	Name    string       `json:"name"`
	Limit   int          `json:"limit"`
	Held    int          `json:"held"`
	Queued  int          `json:"queued"`
	Holders []holderJSON `json:"holders"`
	Queue   []candidate  `json:"queue"`
}

// names are the names "locks" and "ui" give keys, besides pgcoord's own.
type names map[pgcoord.Key]string

// locksStateSQL lists the advisory locks of the current database with
// their backends, and for each waiter the backends that block it.
// pg_locks.waitstart exists from PostgreSQL 14 on; reading it through
// to_jsonb gives NULL on older servers instead of an error.
const locksStateSQL = `SELECT l.classid::int8, l.objid::int8, l.objsubid, l.mode = 'ShareLock', l.granted,
	coalesce(l.pid, 0), coalesce(a.application_name, ''),
	CASE WHEN a.client_port = -1 THEN 'local'
		WHEN a.client_addr IS NULL THEN ''
		ELSE host(a.client_addr) || ':' || a.client_port END,
	CASE WHEN l.granted THEN a.backend_start
		ELSE coalesce((to_jsonb(l) ->> 'waitstart')::timestamptz, a.query_start) END,
	CASE WHEN l.granted OR l.pid IS NULL THEN '{}'::int4[] ELSE pg_blocking_pids(l.pid) END
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
	AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())`

// tablesSQL says whether the schema $1 has the tables readState reads.
const tablesSQL = `SELECT to_regclass(quote_ident($1) || '.leaders') IS NOT NULL
	AND to_regclass(quote_ident($1) || '.semaphores') IS NOT NULL
	AND to_regclass(quote_ident($1) || '.semaphore_holders') IS NOT NULL
	AND to_regclass(quote_ident($1) || '.fences') IS NOT NULL`

// readState reads the state of the database that pool connects to, with
// pgcoord's tables in schema and the user's names: two round trips, the
// second only if the schema has pgcoord's tables. ctx bounds it.
func readState(ctx context.Context, pool *pgxpool.Pool, schema string, user names) (*state, error) {
	st := &state{Time: time.Now(), Schema: schema, Locks: []lockRow{}, Waits: []waitEdge{},
		Elections: []electionRow{}, Semaphores: []semaphoreInfo{}}
	b := &pgx.Batch{}
	b.Queue(locksStateSQL).Query(func(rows pgx.Rows) error {
		var err error
		st.Locks, err = pgx.CollectRows(rows, scanLock)
		return err
	})
	b.Queue(tablesSQL, schema).QueryRow(func(row pgx.Row) error { return row.Scan(&st.Migrated) })
	if err := pool.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("read pg_locks: %w", err)
	}
	type semRow struct {
		name   string
		limit  int
		prefix int64
	}
	var sems []semRow
	var electionKeys []int64
	fences := map[pgcoord.Key]int64{}
	holders := map[string][]holderJSON{}
	if st.Migrated {
		t := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
		b := &pgx.Batch{}
		b.Queue(`SELECT name, identity, term, since, pid, lock_key FROM ` + t("leaders") + ` ORDER BY name`).Query(func(rows pgx.Rows) error {
			var err error
			st.Elections, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (electionRow, error) {
				var e electionRow
				var key int64
				err := r.Scan(&e.Name, &e.Identity, &e.Term, &e.Since, &e.PID, &key)
				electionKeys = append(electionKeys, key)
				return e, err
			})
			return err
		})
		b.Queue(`SELECT name, "limit", lock_key >> 16 FROM ` + t("semaphores") + ` ORDER BY name`).Query(func(rows pgx.Rows) error {
			var err error
			sems, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (semRow, error) {
				var s semRow
				err := r.Scan(&s.name, &s.limit, &s.prefix)
				return s, err
			})
			return err
		})
		b.Queue(`SELECT name, slot, identity, since, pid FROM ` + t("semaphore_holders") + ` ORDER BY name, slot`).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var name string
				var h holderJSON
				if err := rows.Scan(&name, &h.Slot, &h.Identity, &h.Since, &h.PID); err != nil {
					return err
				}
				holders[name] = append(holders[name], h)
			}
			return rows.Err()
		})
		// Only the fences of keys locked now: the table keeps a row for
		// every key ever fenced.
		b.Queue(`SELECT f.key_space, f.key, f.fence FROM ` + t("fences") + ` f
			JOIN pg_locks l ON l.locktype = 'advisory' AND l.objsubid = f.key_space
				AND l.classid::int8 = (f.key >> 32) & 4294967295 AND l.objid::int8 = f.key & 4294967295
				AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
			GROUP BY 1, 2, 3`).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var space int16
				var key, fence int64
				if err := rows.Scan(&space, &key, &fence); err != nil {
					return err
				}
				k, err := pgcoord.KeyFromLock(uint32(uint64(key)>>32), uint32(key), space)
				if err != nil {
					return err
				}
				fences[k] = fence
			}
			return rows.Err()
		})
		if err := pool.SendBatch(ctx, b).Close(); err != nil {
			return nil, fmt.Errorf("read the tables of schema %s: %w", pgx.Identifier{schema}.Sanitize(), err)
		}
	}

	// Name every key.
	byKey := map[pgcoord.Key]keyName{}
	for k, n := range user {
		byKey[k] = keyName{Name: n, Kind: kindUser}
	}
	byKey[pgcoord.HashKey("pgcoord", "migrate")] = keyName{Name: "pgcoord migrations", Kind: kindMigrate}
	electionOf := map[pgcoord.Key]int{}
	for i, e := range st.Elections {
		k := pgcoord.Int64Key(electionKeys[i]) // HashKey("pgcoord.election", schema, name)
		byKey[k] = keyName{Name: "election " + e.Name, Kind: kindElection, Object: e.Name}
		byKey[pgcoord.HashKey("pgcoord.election.guard", schema, e.Name)] = keyName{Name: "election " + e.Name + " guard", Kind: kindElectionGuard, Object: e.Name}
		electionOf[k] = i
	}
	semOf := map[int64]int{} // key >> 16 -> index in st.Semaphores
	for _, s := range sems {
		semOf[s.prefix] = len(st.Semaphores)
		st.Semaphores = append(st.Semaphores, semaphoreInfo{Name: s.name, Limit: s.limit, Holders: []holderJSON{}, Queue: []candidate{}})
	}
	for i := range st.Locks {
		l := &st.Locks[i]
		l.Fence = fences[l.Key]
		if n, ok := byKey[l.Key]; ok {
			l.keyName = n
		} else if v, ok := l.Key.Int64(); ok {
			if si, ok := semOf[v>>16]; ok {
				s := &st.Semaphores[si]
				if slot := int(v & 0xffff); slot == 0xffff {
					l.keyName = keyName{Name: "semaphore " + s.Name + " queue", Kind: kindSemaphoreQ, Object: s.Name}
				} else {
					l.keyName = keyName{Name: fmt.Sprintf("semaphore %s slot %d", s.Name, slot), Kind: kindSemaphoreSlot, Object: s.Name, Slot: &slot}
				}
			}
		}
		for _, b := range l.BlockedBy {
			st.Waits = append(st.Waits, waitEdge{Waiter: l.PID, Blocker: b})
		}
		switch l.Kind {
		case kindElection:
			e := &st.Elections[electionOf[l.Key]]
			if l.Granted {
				e.Leading = e.Leading || l.PID == e.PID
			} else {
				e.Candidates = append(e.Candidates, candidate{PID: l.PID, ApplicationName: l.ApplicationName, Since: l.Since})
			}
		case kindSemaphoreQ:
			s := &st.Semaphores[semOf[mustInt64(l.Key)>>16]]
			s.Queued++
			s.Queue = append(s.Queue, candidate{PID: l.PID, ApplicationName: l.ApplicationName, Since: l.Since, Head: l.Granted})
		case kindSemaphoreSlot:
			s := &st.Semaphores[semOf[mustInt64(l.Key)>>16]]
			if !l.Granted {
				break
			}
			s.Held++
			// The row tells who took the permit, if it is this
			// backend's; the lock is the truth.
			h := holderJSON{Slot: *l.Slot, PID: l.PID}
			for _, r := range holders[s.Name] {
				if r.Slot == h.Slot && r.PID == l.PID {
					h = r
				}
			}
			s.Holders = append(s.Holders, h)
		}
	}
	for i := range st.Elections {
		if st.Elections[i].Candidates == nil {
			st.Elections[i].Candidates = []candidate{}
		}
	}
	for i := range st.Semaphores {
		s := &st.Semaphores[i]
		slices.SortFunc(s.Holders, func(a, b holderJSON) int { return cmp.Compare(a.Slot, b.Slot) })
		slices.SortStableFunc(s.Queue, func(a, b candidate) int {
			if a.Head != b.Head {
				if a.Head {
					return -1
				}
				return 1
			}
			return cmpTime(a.Since, b.Since)
		})
	}
	sortLocks(st.Locks)
	slices.SortFunc(st.Waits, func(a, b waitEdge) int {
		return cmp.Or(cmp.Compare(a.Blocker, b.Blocker), cmp.Compare(a.Waiter, b.Waiter))
	})
	st.Waits = slices.Compact(st.Waits)
	return st, nil
}

func mustInt64(k pgcoord.Key) int64 { v, _ := k.Int64(); return v }

// scanLock scans a row of locksStateSQL.
func scanLock(r pgx.CollectableRow) (lockRow, error) {
	var l lockRow
	var classid, objid int64
	var objsubid int16
	var shared bool
	var since *time.Time
	if err := r.Scan(&classid, &objid, &objsubid, &shared, &l.Granted, &l.PID, &l.ApplicationName, &l.ClientAddr, &since, &l.BlockedBy); err != nil {
		return l, err
	}
	k, err := pgcoord.KeyFromLock(uint32(classid), uint32(objid), objsubid)
	if err != nil {
		return l, err
	}
	l.Key, l.Mode, l.Since = k, pgcoord.ModeExclusive.String(), since
	if shared {
		l.Mode = pgcoord.ModeShared.String()
	}
	if len(l.BlockedBy) == 0 {
		l.BlockedBy = nil
	}
	return l, nil
}

// sortLocks orders rows by name (a key without a name by its number,
// after the named ones), then mode, then holders before waiters, then by
// how long they have held or waited, then by pid.
func sortLocks(locks []lockRow) {
	slices.SortStableFunc(locks, func(a, b lockRow) int {
		if (a.Name == "") != (b.Name == "") {
			if a.Name == "" {
				return 1
			}
			return -1
		}
		c := cmp.Compare(a.Name, b.Name)
		if a.Name == "" {
			c = compareKeys(a.Key, b.Key)
		}
		if c != 0 {
			return c
		}
		if a.Key != b.Key {
			return compareKeys(a.Key, b.Key)
		}
		if a.Mode != b.Mode {
			return cmp.Compare(a.Mode, b.Mode) // exclusive, then shared
		}
		if a.Granted != b.Granted {
			if a.Granted {
				return -1
			}
			return 1
		}
		var ta, tb time.Time
		if a.Since != nil {
			ta = *a.Since
		}
		if b.Since != nil {
			tb = *b.Since
		}
		return cmp.Or(ta.Compare(tb), cmp.Compare(a.PID, b.PID))
	})
}

// compareKeys orders bigint keys by value, before pair keys.
func compareKeys(a, b pgcoord.Key) int {
	av, aok := a.Int64()
	bv, bok := b.Int64()
	switch {
	case aok && bok:
		return cmp.Compare(av, bv)
	case aok != bok:
		if aok {
			return -1
		}
		return 1
	}
	a1, a2, _ := a.Pair()
	b1, b2, _ := b.Pair()
	return cmp.Or(cmp.Compare(a1, b1), cmp.Compare(a2, b2))
}

func cmpTime(a, b *time.Time) int {
	switch {
	case a == nil && b == nil:
		return 0
	case a == nil:
		return 1
	case b == nil:
		return -1
	}
	return a.Compare(*b)
}

// isUndefinedTable reports whether err says that a table or schema does
// not exist.
func isUndefinedTable(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "42P01" || pe.Code == "3F000")
}

// isLockTimeout reports whether err says that a statement gave up waiting
// for a lock (lock_timeout).
func isLockTimeout(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}

// checkName returns a usage error unless v is a name pgcoord accepts for
// an election or a semaphore: 1 to 1024 bytes of UTF-8 without NUL.
func checkName(what, v string) error {
	switch {
	case v == "":
		return usagef("%s must not be empty", what)
	case len(v) > 1024:
		return usagef("%s is %d bytes long; at most 1024 are allowed", what, len(v))
	case strings.ContainsRune(v, 0) || !utf8.ValidString(v):
		return usagef("%s must be UTF-8 without NUL bytes", what)
	}
	return nil
}

// checkSchema returns a usage error unless v is a schema name pgcoord
// accepts: 1 to 63 bytes of UTF-8 without NUL, as PostgreSQL takes it.
func checkSchema(v string) error {
	switch {
	case v == "":
		return usagef("--schema must not be empty (default %q)", pgcoord.DefaultSchema)
	case len(v) > 63:
		return usagef("--schema is %d bytes long; PostgreSQL names are at most 63 bytes", len(v))
	case strings.ContainsRune(v, 0) || !utf8.ValidString(v):
		return usagef("--schema must be UTF-8 without NUL bytes")
	}
	return nil
}
