package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
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
		for _, n := range names {
			if n == "" {
				return usagef("key: a NAME must not be empty")
			}
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

// namesFlags declares --name, --names-file and --sep on fs; the function
// it returns gives the names they name, with the demo's.
func namesFlags(fs *flag.FlagSet) func() (names, error) {
	sep := fs.String("sep", "", "split each --name, and each line of --names-file, into HashKey parts at `SEP`")
	file := fs.String("names-file", "", "read names from `FILE`, one per line, as if each were given with --name\n(blank lines and lines starting with # are skipped)")
	var list []string
	fs.Func("name", "show `NAME` instead of the number of its key, HashKey(NAME) (repeatable)", func(s string) error {
		if s == "" {
			return errors.New("a name must not be empty")
		}
		list = append(list, s)
		return nil
	})
	return func() (names, error) {
		m := names(demoNames())
		if *file != "" {
			b, err := os.ReadFile(*file)
			if err != nil {
				return nil, usagef("--names-file: %v", err)
			}
			for _, line := range strings.Split(string(b), "\n") {
				line = strings.TrimRight(line, "\r")
				if strings.TrimSpace(line) == "" || strings.HasPrefix(strings.TrimSpace(line), "#") {
					continue
				}
				m[keyOf(line, *sep)] = line
			}
		}
		for _, n := range list {
			m[keyOf(n, *sep)] = n
		}
		return m, nil
	}
}

func locksCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	asJSON := fs.Bool("json", false, "print one JSON object per holder or waiter (with --waits: per backend) instead of a table")
	waits := fs.Bool("waits", false, "print who waits for whom: under each backend, the backends waiting for it (pg_blocking_pids)")
	schema := fs.String("schema", pgcoord.DefaultSchema, "name the keys of the elections and semaphores whose tables are in schema `NAME`")
	userNames := namesFlags(fs)
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) > 0 {
			return usagef("locks takes no arguments (names go with --name)")
		}
		m, err := userNames()
		if err != nil {
			return err
		}
		pool, err := openSchemaPool(ctx, e, *schema)
		if err != nil {
			return err
		}
		defer pool.Close()
		st, err := readState(ctx, pool, *schema, m)
		if err != nil {
			return err
		}
		if *waits {
			roots := waitForest(st)
			if *asJSON {
				return encodeLines(e.stdout, flatten(roots))
			}
			printWaits(e.stdout, roots, time.Now())
			return nil
		}
		if *asJSON {
			return encodeLines(e.stdout, st.Locks)
		}
		return printLocks(e, st.Locks, time.Now())
	}
}

// printLocks writes the table of "pgcoord locks": one row per holder and
// per waiter, in the order of sortLocks, with the number of waiters of
// each key on its holders' rows.
func printLocks(e *env, locks []lockRow, now time.Time) error {
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
	fmt.Fprintln(tw, "LOCK\tMODE\tSTATE\tPID\tAPPLICATION\tCLIENT\tFOR\tFENCE\tWAITERS")
	for _, l := range locks {
		state, since, nWait, fence := "waiting", "", "", ""
		if l.Since != nil {
			since = duration(now.Sub(*l.Since))
		}
		if l.Granted {
			state, nWait = "held", strconv.Itoa(waiters[l.Key])
			if since != "" {
				// PostgreSQL does not record when a lock was granted: the
				// time is since the holder's connection was opened, an
				// upper bound.
				since = "<=" + since
			}
		}
		if l.Fence != 0 {
			fence = strconv.FormatInt(l.Fence, 10)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\n", l.label(), l.Mode, state, l.PID, orDash(l.ApplicationName),
			orDash(l.ClientAddr), orDash(since), orDash(fence), orDash(nWait))
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
	PID      int32          `json:"pid"`               // the terminated backend
	Released []releasedJSON `json:"released"`          // the locks it held
	Awaited  []releasedJSON `json:"awaited,omitempty"` // the locks it waited for, if any
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
		if n := len(*app); n == 0 || n > 63 {
			return usagef("release: --app must be an application_name of 1 to 63 bytes, got %d bytes", n)
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
		res := releaseJSON{PID: int32(*pid), Released: []releasedJSON{}}
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

// migrateJSON is the line of "pgcoord migrate --json".
type migrateJSON struct {
	Schema          string `json:"schema"`
	Action          string `json:"action"`           // "created", "migrated" or "none"
	PreviousVersion int64  `json:"previous_version"` // 0 when the schema had no pgcoord tables
	Version         int64  `json:"version"`
}

func migrateCmd(fs *flag.FlagSet) func(context.Context, *env, []string) error {
	schema := fs.String("schema", pgcoord.DefaultSchema, "the `NAME` of the schema of pgcoord's tables")
	asJSON := fs.Bool("json", false, "print what was done as one JSON object: schema, action (created, migrated, none),\nprevious_version, version")
	return func(ctx context.Context, e *env, args []string) error {
		if len(args) > 0 {
			return usagef("migrate takes no arguments")
		}
		if err := checkSchema(*schema); err != nil {
			return err
		}
		pool, err := openPool(ctx, e, 0) // a migration waits for its locks
		if err != nil {
			return err
		}
		defer pool.Close()
		versionTable := pgx.Identifier{*schema, "schema_version"}.Sanitize()
		readVersion := func() (int64, error) {
			var v int64
			var exists bool
			err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", versionTable).Scan(&exists)
			if err == nil && exists {
				err = pool.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+versionTable).Scan(&v)
			}
			if err != nil {
				return 0, fmt.Errorf("read the schema version: %w", err)
			}
			return v, nil
		}
		before, err := readVersion()
		if err != nil {
			return err
		}
		if err := pgcoord.Migrate(ctx, pool, pgcoord.WithSchema(*schema)); err != nil {
			return err
		}
		after, err := readVersion()
		if err != nil {
			return err
		}
		res := migrateJSON{Schema: *schema, Action: "none", PreviousVersion: before, Version: after}
		switch {
		case before == 0 && after > 0:
			res.Action = "created"
		case after != before:
			res.Action = "migrated"
		}
		if *asJSON {
			return json.NewEncoder(e.stdout).Encode(res)
		}
		q := pgx.Identifier{*schema}.Sanitize()
		switch res.Action {
		case "created":
			fmt.Fprintf(e.stdout, "created pgcoord's tables in schema %s at version %d\n", q, after)
		case "migrated":
			fmt.Fprintf(e.stdout, "migrated schema %s from version %d to %d\n", q, before, after)
		default:
			fmt.Fprintf(e.stdout, "schema %s is already at version %d; nothing to do\n", q, after)
		}
		return nil
	}
}

// leaderJSON is the line of "pgcoord leader --json".
type leaderJSON struct {
	Name            string    `json:"name"` // the election's
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
		if err := checkName("the election name", args[0]); err != nil {
			return err
		}
		pool, err := openSchemaPool(ctx, e, *schema)
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
		pool, err := openSchemaPool(ctx, e, *schema)
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
			if isUndefinedTable(err) {
				return fmt.Errorf("schema %s has no semaphores table (run \"pgcoord migrate --schema %s\" first?): %w",
					pgx.Identifier{*schema}.Sanitize(), *schema, err)
			}
			return fmt.Errorf("read semaphores: %w", err)
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
			return encodeLines(e.stdout, sems)
		}
		if len(sems) == 0 {
			fmt.Fprintf(e.stdout, "no semaphores in schema %s\n", pgx.Identifier{*schema}.Sanitize())
			return nil
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
		if !*holders {
			fmt.Fprintln(tw, "SEMAPHORE\tLIMIT\tHELD\tQUEUED")
			for _, s := range sems {
				fmt.Fprintf(tw, "%s\t%d\t%d\t%d\n", s.Name, s.Limit, s.Held, s.Queued)
			}
			return tw.Flush()
		}
		// One row per holder, under the columns of the holders; a
		// semaphore without holders has one row with dashes.
		now := time.Now()
		fmt.Fprintln(tw, "SEMAPHORE\tLIMIT\tHELD\tQUEUED\tSLOT\tHOLDER\tPID\tFOR")
		for _, s := range sems {
			if len(s.Holders) == 0 {
				fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t-\t-\t-\t-\n", s.Name, s.Limit, s.Held, s.Queued)
			}
			for _, h := range s.Holders {
				fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%s\t%d\t%s\n", s.Name, s.Limit, s.Held, s.Queued, h.Slot, h.Identity, h.PID, duration(now.Sub(h.Since)))
			}
		}
		return tw.Flush()
	}
}

// electionJSON is one election as "pgcoord elections" shows it, and a line
// of its --json output.
type electionJSON struct {
	Name     string    `json:"name"`     // the election's
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
		pool, err := openSchemaPool(ctx, e, *schema)
		if err != nil {
			return err
		}
		defer pool.Close()
		rows, err := pool.Query(ctx, fmt.Sprintf(electionsSQL, pgx.Identifier{*schema, "leaders"}.Sanitize()))
		if err != nil {
			if isUndefinedTable(err) {
				return fmt.Errorf("schema %s has no leaders table (run \"pgcoord migrate --schema %s\" first?): %w",
					pgx.Identifier{*schema}.Sanitize(), *schema, err)
			}
			return fmt.Errorf("read elections: %w", err)
		}
		els, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (electionJSON, error) {
			var el electionJSON
			err := r.Scan(&el.Name, &el.Identity, &el.Term, &el.Since, &el.PID, &el.Leading)
			return el, err
		})
		if err != nil {
			return fmt.Errorf("read elections: %w", err)
		}
		if *asJSON {
			return encodeLines(e.stdout, els)
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
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%d\n", el.Name, leading, el.Identity, el.Term,
				el.Since.Format(time.RFC3339), since, el.PID)
		}
		return tw.Flush()
	}
}
