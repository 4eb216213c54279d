package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord"
)

// keyOf returns the key of a name: HashKey(name), or HashKey of its parts
// when sep is set.
func keyOf(name, sep string) pgcoord.Key {
	if sep == "" {
		return pgcoord.HashKey(name)
	}
	return pgcoord.HashKey(strings.Split(name, sep)...)
}

// lockColumns returns the classid, objid and objsubid that k has in
// pg_locks.
func lockColumns(k pgcoord.Key) (classid, objid uint32, objsubid int16) {
	if a, b, ok := k.Pair(); ok {
		return uint32(a), uint32(b), 2
	}
	v, _ := k.Int64()
	return uint32(uint64(v) >> 32), uint32(v), 1
}

// keyJSON is one line of "pgcoord key --json".
type keyJSON struct {
	Name     string      `json:"name"`
	Key      pgcoord.Key `json:"key"`
	Value    int64       `json:"value"` // the bigint passed to pg_advisory_lock
	ClassID  uint32      `json:"classid"`
	ObjID    uint32      `json:"objid"`
	ObjSubID int16       `json:"objsubid"`
}

func keyCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	sep := fs.String("sep", "", "split each NAME into HashKey parts at `SEP`")
	asJSON := fs.Bool("json", false, "print one JSON object per NAME instead of a table")
	return func(_ context.Context, e *env, names []string) error {
		if len(names) == 0 {
			return usagef("key: give at least one NAME")
		}
		if *asJSON {
			enc := json.NewEncoder(e.stdout)
			for _, n := range names {
				k := keyOf(n, *sep)
				v, _ := k.Int64()
				classid, objid, objsubid := lockColumns(k)
				if err := enc.Encode(keyJSON{n, k, v, classid, objid, objsubid}); err != nil {
					return err
				}
			}
			return nil
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tKEY\tCLASSID\tOBJID\tOBJSUBID")
		for _, n := range names {
			k := keyOf(n, *sep)
			classid, objid, objsubid := lockColumns(k)
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\n", n, k, classid, objid, objsubid)
		}
		return tw.Flush()
	}
}

// lockJSON is one line of "pgcoord locks --json".
type lockJSON struct {
	Key             pgcoord.Key `json:"key"`
	Name            string      `json:"name,omitempty"`
	Mode            string      `json:"mode"`
	Granted         bool        `json:"granted"`
	PID             int32       `json:"pid"`
	ApplicationName string      `json:"application_name"`
	ClientAddr      string      `json:"client_addr"`
	Since           *time.Time  `json:"since,omitempty"`
}

func locksCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	asJSON := fs.Bool("json", false, "print one JSON object per holder or waiter instead of a table")
	sep := fs.String("sep", "", "split each --name into HashKey parts at `SEP`")
	var names []string
	fs.Func("name", "show `NAME` instead of the number of its key, HashKey(NAME) (repeatable)", func(s string) error {
		names = append(names, s)
		return nil
	})
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) > 0 {
			return usagef("locks takes no arguments (names go with --name)")
		}
		m := demoNames()
		for _, n := range names {
			m[keyOf(n, *sep)] = n
		}
		c, closeAll, err := openClient(ctx, e, pgcoord.WithKeyNames(m))
		if err != nil {
			return err
		}
		defer closeAll()
		locks, err := c.Locks(ctx)
		if err != nil {
			return err
		}
		if *asJSON {
			enc := json.NewEncoder(e.stdout)
			for _, l := range locks {
				j := lockJSON{Key: l.Key, Name: l.Name, Mode: l.Mode.String(), Granted: l.Granted, PID: l.PID,
					ApplicationName: l.ApplicationName, ClientAddr: l.ClientAddr}
				if !l.Since.IsZero() {
					j.Since = &l.Since
				}
				if err := enc.Encode(j); err != nil {
					return err
				}
			}
			return nil
		}
		return printLocks(e, locks, time.Now())
	}
}

// printLocks writes the table of "pgcoord locks": one row per holder and
// per waiter, holders first, with the number of waiters of each key on
// its holders' rows.
func printLocks(e *env, locks []pgcoord.LockInfo, now time.Time) error {
	if len(locks) == 0 {
		fmt.Fprintln(e.stdout, "no advisory locks in this database")
		return nil
	}
	waiters := make(map[pgcoord.Key]int)
	for _, l := range locks {
		if !l.Granted {
			waiters[l.Key]++
		}
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tMODE\tSTATE\tPID\tAPPLICATION\tCLIENT\tFOR\tWAITERS")
	for _, l := range locks {
		name := l.Name
		if name == "" {
			name = l.Key.String()
		}
		state, since, nWait := "waiting", "", ""
		if !l.Since.IsZero() {
			since = duration(now.Sub(l.Since))
		}
		if l.Granted {
			state, nWait = "held", strconv.Itoa(waiters[l.Key])
			if since != "" {
				// PostgreSQL does not record when a lock was granted: the
				// time is since the holder's transaction or connection
				// began, an upper bound.
				since = "<=" + since
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", name, l.Mode, state, l.PID, orDash(l.ApplicationName), orDash(l.ClientAddr), orDash(since), nWait)
	}
	return tw.Flush()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// duration formats d to a precision that suits its size.
func duration(d time.Duration) string {
	switch {
	case d < 0:
		d = 0
	case d >= time.Minute:
		return d.Round(time.Second).String()
	case d >= time.Second:
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Millisecond).String()
}

// releaseJSON is the line of "pgcoord release --json".
type releaseJSON struct {
	PID      int32          `json:"pid"`      // the terminated backend
	Released []releasedJSON `json:"released"` // the locks it held
	Awaited  []releasedJSON `json:"awaited"`  // the locks it waited for
}

// releasedJSON is a lock of a terminated backend.
type releasedJSON struct {
	Key  pgcoord.Key `json:"key"`
	Name string      `json:"name,omitempty"`
	Mode string      `json:"mode"`
}

func releaseCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	pid := fs.Int("pid", 0, "process ID `N` of the backend, as 'pgcoord locks' shows it (required)")
	force := fs.Bool("force", false, "terminate the backend even if it is not pgcoord's")
	app := fs.String("app", "pgcoord", "the application_name `NAME` that marks pgcoord's backends (WithApplicationName)")
	asJSON := fs.Bool("json", false, "print the result as one JSON object")
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) > 0 {
			return usagef("release takes no arguments (the backend goes with --pid)")
		}
		if *pid <= 0 || *pid > 1<<31-1 {
			return usagef("release: give the backend's process ID with --pid N")
		}
		c, closeAll, err := openClient(ctx, e, pgcoord.WithApplicationName(*app), pgcoord.WithKeyNames(demoNames()))
		if err != nil {
			return err
		}
		defer closeAll()
		all, err := c.Locks(ctx)
		if err != nil {
			return err
		}
		var held, awaited []string
		res := releaseJSON{PID: int32(*pid), Released: []releasedJSON{}, Awaited: []releasedJSON{}}
		for _, l := range all {
			if l.PID != int32(*pid) {
				continue
			}
			name := l.Name
			if name == "" {
				name = l.Key.String()
			}
			r := releasedJSON{Key: l.Key, Name: l.Name, Mode: l.Mode.String()}
			if l.Granted {
				held = append(held, name+" ("+l.Mode.String()+")")
				res.Released = append(res.Released, r)
			} else {
				awaited = append(awaited, name)
				res.Awaited = append(res.Awaited, r)
			}
		}
		terminate := c.Terminate
		if *force {
			terminate = c.TerminateAny
		}
		if err := terminate(ctx, int32(*pid)); err != nil {
			if errors.Is(err, pgcoord.ErrForeignBackend) {
				// Name the flag, not the library's TerminateAny.
				msg, _, _ := strings.Cut(err.Error(), "; use TerminateAny")
				return errors.New(msg + "; pass --force to terminate it anyway")
			}
			return err
		}
		if *asJSON {
			return json.NewEncoder(e.stdout).Encode(res)
		}
		fmt.Fprintf(e.stdout, "terminated backend %d\n", *pid)
		if len(held) > 0 {
			fmt.Fprintf(e.stdout, "released: %s\n", strings.Join(held, ", "))
		}
		if len(awaited) > 0 {
			fmt.Fprintf(e.stdout, "it no longer waits for: %s\n", strings.Join(awaited, ", "))
		}
		if len(held)+len(awaited) == 0 {
			fmt.Fprintln(e.stdout, "it held no advisory lock in this database")
		}
		return nil
	}
}

func migrateCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	schema := fs.String("schema", pgcoord.DefaultSchema, "the `NAME` of the schema of pgcoord's tables (WithSchema)")
	asJSON := fs.Bool("json", false, "print the schema and its version as one JSON object")
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) > 0 {
			return usagef("migrate takes no arguments")
		}
		pool, err := openPool(ctx, e)
		if err != nil {
			return err
		}
		defer pool.Close()
		if err := pgcoord.Migrate(ctx, pool, pgcoord.WithSchema(*schema)); err != nil {
			return err
		}
		var version int64
		q := "SELECT max(version) FROM " + pgx.Identifier{*schema, "schema_version"}.Sanitize()
		if err := pool.QueryRow(ctx, q).Scan(&version); err != nil {
			return fmt.Errorf("read the schema version: %w", err)
		}
		if *asJSON {
			return json.NewEncoder(e.stdout).Encode(struct {
				Schema  string `json:"schema"`
				Version int64  `json:"version"`
			}{*schema, version})
		}
		fmt.Fprintf(e.stdout, "schema %s is at version %d\n", pgx.Identifier{*schema}.Sanitize(), version)
		return nil
	}
}

// leaderJSON is the line of "pgcoord leader --json".
type leaderJSON struct {
	Election        string    `json:"election"`
	Identity        string    `json:"identity"`
	Term            int64     `json:"term"`
	Since           time.Time `json:"since"`
	PID             int32     `json:"pid"`
	ResignRequested bool      `json:"resign_requested"`
}

func leaderCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	schema := fs.String("schema", pgcoord.DefaultSchema, "the `NAME` of the schema of pgcoord's tables (WithSchema)")
	asJSON := fs.Bool("json", false, "print the leader as one JSON object")
	resign := fs.Bool("resign", false, "ask the leader to step down (RequestResign); another candidate takes over")
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) != 1 {
			return usagef("leader takes one election name, got %d arguments", len(args))
		}
		pool, err := openPool(ctx, e)
		if err != nil {
			return err
		}
		defer pool.Close()
		c, err := pgcoord.New(pool, pgcoord.WithSchema(*schema), pgcoord.WithApplicationName("pgcoord-cli"))
		if err != nil {
			return err
		}
		defer c.Close(context.Background())
		el := c.Election(args[0])
		info, err := el.Leader(ctx)
		if err != nil {
			return err
		}
		if *resign {
			if err := el.RequestResign(ctx); err != nil {
				return err
			}
		}
		if *asJSON {
			return json.NewEncoder(e.stdout).Encode(leaderJSON{args[0], info.Identity, int64(info.Term), info.Since, info.PID, *resign})
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "ELECTION\tIDENTITY\tTERM\tSINCE\tLEADING FOR\tPID")
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%d\n", args[0], info.Identity, info.Term,
			info.Since.Format(time.RFC3339), time.Since(info.Since).Round(time.Millisecond), info.PID)
		if err := tw.Flush(); err != nil {
			return err
		}
		if *resign {
			fmt.Fprintf(e.stdout, "asked term %d to step down\n", info.Term)
		}
		return nil
	}
}

// semaphoreRow is one semaphore as "pgcoord semaphores" shows it, and a
// line of its --json output.
type semaphoreRow struct {
	Name    string       `json:"name"`
	Limit   int          `json:"limit"`
	Held    int          `json:"held"`
	Queued  int          `json:"queued"`
	Holders []holderJSON `json:"holders,omitempty"` // with --holders only
}

// holderJSON is a holder of a semaphore's permit.
type holderJSON struct {
	Slot     int       `json:"slot"`
	Identity string    `json:"identity"`
	Since    time.Time `json:"since"`
	PID      int32     `json:"pid"`
}

func semaphoresCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	schema := fs.String("schema", pgcoord.DefaultSchema, "the `NAME` of the schema of pgcoord's tables (WithSchema)")
	asJSON := fs.Bool("json", false, "print one JSON object per semaphore instead of a table")
	holders := fs.Bool("holders", false, "list each live holder: slot, identity, since, backend pid")
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) > 0 {
			return usagef("semaphores takes no arguments")
		}
		pool, err := openPool(ctx, e)
		if err != nil {
			return err
		}
		defer pool.Close()
		// A semaphore's locks share the upper 48 bits of its key: the low
		// 16 bits are the slot of a permit, or 65535 for the queue.
		rows, err := pool.Query(ctx, `WITH k AS (
				SELECT ((classid::bigint << 32) | objid::bigint) AS key, granted FROM pg_locks
				WHERE locktype = 'advisory' AND objsubid = 1
				AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
			SELECT s.name, s."limit",
				(SELECT count(*) FROM k WHERE k.granted AND k.key >> 16 = s.lock_key >> 16 AND k.key & 65535 <> 65535),
				(SELECT count(*) FROM k WHERE k.key >> 16 = s.lock_key >> 16 AND k.key & 65535 = 65535)
			FROM `+pgx.Identifier{*schema, "semaphores"}.Sanitize()+` AS s ORDER BY s.name`)
		if err != nil {
			return fmt.Errorf("read semaphores (run \"pgcoord migrate\" first?): %w", err)
		}
		sems, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (semaphoreRow, error) {
			var s semaphoreRow
			err := r.Scan(&s.Name, &s.Limit, &s.Held, &s.Queued)
			return s, err
		})
		if err != nil {
			return fmt.Errorf("read semaphores: %w", err)
		}
		if *holders && len(sems) > 0 {
			c, err := pgcoord.New(pool, pgcoord.WithSchema(*schema))
			if err != nil {
				return err
			}
			defer c.Close(context.Background())
			for i := range sems {
				hs, err := c.Semaphore(sems[i].Name, 1).Holders(ctx)
				if err != nil {
					return err
				}
				sems[i].Holders = make([]holderJSON, len(hs))
				for j, h := range hs {
					sems[i].Holders[j] = holderJSON{h.Slot, h.Identity, h.Since, h.PID}
				}
			}
		}
		if *asJSON {
			enc := json.NewEncoder(e.stdout)
			for _, s := range sems {
				if err := enc.Encode(s); err != nil {
					return err
				}
			}
			return nil
		}
		if len(sems) == 0 {
			fmt.Fprintf(e.stdout, "no semaphores in schema %s\n", pgx.Identifier{*schema}.Sanitize())
			return nil
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "SEMAPHORE\tLIMIT\tHELD\tQUEUED")
		for _, s := range sems {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\n", s.Name, s.Limit, s.Held, s.Queued)
			for _, h := range s.Holders {
				fmt.Fprintf(tw, "  slot %d\t%s\tpid %d\tsince %s\n", h.Slot, h.Identity, h.PID, h.Since.Format(time.RFC3339))
			}
		}
		return tw.Flush()
	}
}

// electionJSON is one election as "pgcoord elections" shows it, and a line
// of its --json output.
type electionJSON struct {
	Election string    `json:"election"`
	Identity string    `json:"identity"` // of the latest leader
	Term     int64     `json:"term"`
	Since    time.Time `json:"since"`
	PID      int32     `json:"pid"`
	Leading  bool      `json:"leading"` // PID still holds the election's lock
}

// electionsSQL lists the leaders table, and for each row whether its
// backend still holds the election's lock, as Election.Leader checks it.
const electionsSQL = `SELECT l.name, l.identity, l.term, l.since, l.pid,
	EXISTS (SELECT 1 FROM pg_locks AS k
		WHERE k.locktype = 'advisory' AND k.granted AND k.pid = l.pid
		AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
		AND k.classid::bigint = (l.lock_key >> 32) & 4294967295
		AND k.objid::bigint = l.lock_key & 4294967295 AND k.objsubid = 1)
FROM %s AS l ORDER BY l.name`

func electionsCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	schema := fs.String("schema", pgcoord.DefaultSchema, "the `NAME` of the schema of pgcoord's tables (WithSchema)")
	asJSON := fs.Bool("json", false, "print one JSON object per election instead of a table")
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) > 0 {
			return usagef("elections takes no arguments (for one election: pgcoord leader ELECTION)")
		}
		pool, err := openPool(ctx, e)
		if err != nil {
			return err
		}
		defer pool.Close()
		rows, err := pool.Query(ctx, fmt.Sprintf(electionsSQL, pgx.Identifier{*schema, "leaders"}.Sanitize()))
		if err != nil {
			return fmt.Errorf("read elections (run \"pgcoord migrate\" first?): %w", err)
		}
		els, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (electionJSON, error) {
			var el electionJSON
			err := r.Scan(&el.Election, &el.Identity, &el.Term, &el.Since, &el.PID, &el.Leading)
			return el, err
		})
		if err != nil {
			return fmt.Errorf("read elections: %w", err)
		}
		if *asJSON {
			enc := json.NewEncoder(e.stdout)
			for _, el := range els {
				if err := enc.Encode(el); err != nil {
					return err
				}
			}
			return nil
		}
		if len(els) == 0 {
			fmt.Fprintf(e.stdout, "no elections in schema %s\n", pgx.Identifier{*schema}.Sanitize())
			return nil
		}
		now := time.Now()
		tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "ELECTION\tLEADING\tIDENTITY\tTERM\tSINCE\tFOR\tPID")
		for _, el := range els {
			leading, since := "yes", duration(now.Sub(el.Since))
			if !el.Leading {
				leading, since = "no (ended)", "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%d\n", el.Election, leading, el.Identity, el.Term,
				el.Since.Format(time.RFC3339), since, el.PID)
		}
		return tw.Flush()
	}
}
