// Command pgcoord is the operator's view of pgcoord's advisory locks: who
// holds and who waits for which key, how a name maps to a key in pg_locks,
// who leads which election, how full each semaphore is, how to force-release
// a stuck lock, and how to apply pgcoord's migrations.
//
// Usage:
//
//	pgcoord [--db URL] [--connect-timeout D] COMMAND [FLAGS] [ARGS]
//
// Flags and arguments may come in any order after COMMAND; "--" ends the
// flags. Run "pgcoord help" for the commands, their flags, the JSON output
// and the exit codes.
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
)

// Exit codes, documented in the help text.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
	exitNone    = 3
)

// defaultConnectTimeout bounds the connect when --connect-timeout is not
// given and the connection string sets no connect_timeout.
const defaultConnectTimeout = 10 * time.Second

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// env is what a command runs with.
type env struct {
	db             string // connection string, from --db or DATABASE_URL; "" for the libpq environment
	dbSource       string // where db came from, for error messages
	connectTimeout time.Duration
	timeoutSet     bool   // --connect-timeout was given
	appName        string // the application_name of the connections, unless the settings give one; "" for pgcoord-cli
	stdout         io.Writer
	stderr         io.Writer
}

// A command is one subcommand. flags declares its flags on fs; run runs it
// with the arguments left after the flags.
type command struct {
	name    string
	args    string // synopsis of the flags and arguments, for the help text
	summary string
	details string // more help, for "pgcoord help COMMAND"; may be empty
	flags   func(fs *flag.FlagSet) func(ctx context.Context, e *env, args []string) error
}

// commands lists the subcommands in the order the help text shows them.
// A new subcommand is one more entry here.
var commands = []command{
	{name: "locks", args: "[--json] [--waits] [--name NAME]... [--names-file FILE] [--sep SEP] [--schema NAME]", flags: locksCmd,
		summary: "list the advisory locks of the database: holders and waiters, by name; --waits shows who waits for whom",
		details: `Each key shows by its name where pgcoord knows one: the names given with
--name or --names-file (and the demo's), and pgcoord's own keys, found in
the tables of --schema: "election NAME" (whoever holds it leads), "election
NAME guard", "semaphore NAME slot N" (a permit), "semaphore NAME queue" (its
holder is next in line, its waiters queue behind). FENCE is the last fence
issued for the key (an election's term). Rows are sorted by name, then
mode, holders before waiters.

With --waits, pgcoord prints the wait-for forest: each backend that others
wait for, and under it the backends that wait for a lock it holds or wait
behind it in a lock's queue (pg_blocking_pids). A backend that closes a
cycle is marked CYCLE; PostgreSQL breaks a cycle of lock waits with a
deadlock error after deadlock_timeout.`},
	{name: "key", args: "[--json] [--sep SEP] NAME...", flags: keyCmd,
		summary: "print HashKey(NAME) and the classid/objid/objsubid it has in pg_locks (no database needed)"},
	{name: "release", args: "--pid N [--force] [--app NAME] [--json]", flags: releaseCmd,
		summary: "force-release the locks of a backend by terminating it"},
	{name: "leader", args: "[--schema NAME] [--json] [--resign] ELECTION", flags: leaderCmd,
		summary: "show who leads an election (identity, term, since, backend pid); --resign asks it to step down"},
	{name: "elections", args: "[--schema NAME] [--json]", flags: electionsCmd,
		summary: "list every election with its latest leader, and whether that leader still holds the election",
		details: `An election whose latest leader no longer holds the election's lock (its
backend has ended, or it resigned) shows as not leading; its row stays
until the next leader replaces it.`},
	{name: "semaphores", args: "[--schema NAME] [--json] [--holders]", flags: semaphoresCmd,
		summary: "list the semaphores: limit, permits held, processes queued; --holders lists each holder"},
	{name: "migrate", args: "[--schema NAME] [--json]", flags: migrateCmd,
		summary: "create or update pgcoord's tables (fences, leaders, semaphores) in a schema"},
	{name: "ui", args: "[--addr HOST:PORT] [--interval D] [--schema NAME] [--name NAME]... [--names-file FILE] [--sep SEP]", flags: uiCmd,
		summary: "serve a read-only live page: locks by name, the wait-for graph, elections, semaphores",
		details: `The page is served on 127.0.0.1:8080 unless --addr says otherwise, and
loads nothing from anywhere else. It updates itself as the database
changes: pgcoord reads the database once per --interval while a page is
open, however many pages are open, and sends each page the result
(server-sent events). When the database cannot be reached the page says
so, keeps the last state it read, and pgcoord retries every interval.
The page has no buttons: to end a backend, use "pgcoord release".`},
	{name: "demo", args: "", flags: demoCmd,
		summary: "take a few locks and hold them until interrupted, for 'pgcoord locks' to show"},
}

// lookupCommand returns the command called name, or nil.
func lookupCommand(name string) *command {
	for i := range commands {
		if commands[i].name == name {
			return &commands[i]
		}
	}
	return nil
}

// usageError is a mistake in the command line: exit code 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

// globals are the flags that every command takes, before or after its
// name.
type globals struct {
	db             string
	connectTimeout time.Duration
	version        bool
}

// register declares the global flags on fs, bound to g.
func (g *globals) register(fs *flag.FlagSet) {
	fs.StringVar(&g.db, "db", g.db, "connect to `URL` (a postgres:// URL or a keyword/value string);\n"+
		"default: $DATABASE_URL, else the libpq environment (PGHOST, PGPORT, PGUSER,\n"+
		"PGPASSWORD, PGDATABASE, PGSERVICE, PGPASSFILE, PGSSLMODE, ...) and its defaults")
	fs.DurationVar(&g.connectTimeout, "connect-timeout", g.connectTimeout,
		"give up connecting after `DURATION` (e.g. 500ms, 10s, 1m; 0: no limit);\n"+
			"without this flag, the connection string's connect_timeout if it sets one")
	fs.BoolVar(&g.version, "version", g.version, "print pgcoord's version and exit")
}

// newGlobals returns the global flags with their defaults.
func newGlobals() *globals { return &globals{connectTimeout: defaultConnectTimeout} }

// newFlagSet returns the flag set of cmd, with the global flags bound to
// g, and the function that runs cmd with the flags fs parsed.
func newFlagSet(cmd *command, g *globals) (*flag.FlagSet, func(context.Context, *env, []string) error) {
	fs := flag.NewFlagSet("pgcoord "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	runCmd := cmd.flags(fs)
	g.register(fs)
	return fs, runCmd
}

// run runs the command line args and returns the exit code. ctx ends the
// command (the demo runs until it is done).
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	g := newGlobals()
	global := flag.NewFlagSet("pgcoord", flag.ContinueOnError)
	global.SetOutput(io.Discard)
	g.register(global)
	args, err := parseFlags(global, args, true)
	switch {
	case errors.Is(err, flag.ErrHelp):
		printHelp(stdout)
		return exitOK
	case err != nil:
		return fail(stderr, usagef("%v; run \"pgcoord help\"", err))
	case g.version:
		fmt.Fprintln(stdout, "pgcoord", version())
		return exitOK
	case len(args) == 0:
		printHelp(stderr)
		return exitUsage
	case args[0] == "help":
		return help(stdout, stderr, args[1:])
	}
	cmd := lookupCommand(args[0])
	if cmd == nil {
		return fail(stderr, usagef("unknown command %q; run \"pgcoord help\"", args[0]))
	}
	fs, runCmd := newFlagSet(cmd, g)
	rest, err := parseFlags(fs, args[1:], false)
	switch {
	case errors.Is(err, flag.ErrHelp):
		printCommandHelp(stdout, cmd)
		return exitOK
	case err != nil:
		return fail(stderr, usagef("%s: %v; run \"pgcoord help %s\"", cmd.name, err, cmd.name))
	case g.version:
		fmt.Fprintln(stdout, "pgcoord", version())
		return exitOK
	}
	e := &env{db: g.db, dbSource: "--db", connectTimeout: g.connectTimeout, stdout: stdout, stderr: stderr}
	global.Visit(func(f *flag.Flag) { e.timeoutSet = e.timeoutSet || f.Name == "connect-timeout" })
	fs.Visit(func(f *flag.Flag) { e.timeoutSet = e.timeoutSet || f.Name == "connect-timeout" })
	if e.connectTimeout < 0 {
		return fail(stderr, usagef("%s: --connect-timeout must not be negative", cmd.name))
	}
	if e.db == "" {
		e.db, e.dbSource = getenv("DATABASE_URL"), "DATABASE_URL"
	}
	if e.db == "" {
		e.dbSource = ""
	}
	return fail(stderr, runCmd(ctx, e, rest))
}

// help runs "pgcoord help [COMMAND]".
func help(stdout, stderr io.Writer, args []string) int {
	switch len(args) {
	case 0:
		printHelp(stdout)
		return exitOK
	case 1:
		if cmd := lookupCommand(args[0]); cmd != nil {
			printCommandHelp(stdout, cmd)
			return exitOK
		}
		return fail(stderr, usagef("help: unknown command %q; run \"pgcoord help\"", args[0]))
	}
	return fail(stderr, usagef("help takes at most one command name"))
}

// parseFlags parses the flags in args into fs and returns the other
// arguments. Flags may come before, between and after the arguments, as
// -name or --name, with their value after "=" or as the next argument
// (boolean flags take "=" only); "--" ends the flags, and "-" is an
// argument. With stopAtArg, parsing stops at the first argument, which is
// returned with everything after it. -h and --help return flag.ErrHelp.
func parseFlags(fs *flag.FlagSet, args []string, stopAtArg bool) ([]string, error) {
	var rest []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return append(rest, args[i+1:]...), nil
		}
		if len(a) < 2 || a[0] != '-' {
			if stopAtArg {
				return append(rest, args[i:]...), nil
			}
			rest = append(rest, a)
			continue
		}
		name := strings.TrimPrefix(a[1:], "-")
		if name == "" || name[0] == '-' || name[0] == '=' {
			return nil, fmt.Errorf("bad flag syntax: %s", a)
		}
		name, value, hasValue := strings.Cut(name, "=")
		f := fs.Lookup(name)
		if f == nil {
			if name == "h" || name == "help" {
				return nil, flag.ErrHelp
			}
			return nil, fmt.Errorf("flag provided but not defined: --%s", name)
		}
		if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
			if !hasValue {
				value = "true"
			}
		} else if !hasValue {
			if i+1 == len(args) {
				return nil, fmt.Errorf("flag needs an argument: --%s", name)
			}
			i++
			value = args[i]
		}
		if err := fs.Set(name, value); err != nil {
			return nil, fmt.Errorf("invalid value %q for flag --%s: %v", value, name, err)
		}
	}
	return rest, nil
}

// version returns the module version pgcoord was built from:
// "go install ...@v0.1.0" gives v0.1.0, a build in a checkout a
// pseudo-version or "(devel)".
func version() string {
	if info, ok := debug.ReadBuildInfo(); ok && info.Main.Version != "" {
		return info.Main.Version
	}
	return "(devel)"
}

// fail reports err on stderr and returns its exit code.
func fail(stderr io.Writer, err error) int {
	var ue usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintln(stderr, "pgcoord:", ue.msg)
		return exitUsage
	case errors.Is(err, pgcoord.ErrNoLeader):
		fmt.Fprintln(stderr, "pgcoord:", strings.TrimPrefix(err.Error(), "pgcoord: "))
		return exitNone
	case isLockTimeout(err):
		fmt.Fprintf(stderr, "pgcoord: %s\n(another session holds a lock on one of pgcoord's tables, as ALTER TABLE, VACUUM FULL and LOCK TABLE take: pg_locks shows which; try again once it has ended)\n",
			strings.TrimPrefix(err.Error(), "pgcoord: "))
		return exitFailure
	}
	fmt.Fprintln(stderr, "pgcoord:", strings.TrimPrefix(err.Error(), "pgcoord: "))
	return exitFailure
}

const helpText = `pgcoord: inspect and manage pgcoord's PostgreSQL advisory locks,
elections and semaphores.

Usage:
  pgcoord [GLOBAL FLAGS] COMMAND [FLAGS] [ARGS]
  pgcoord help [COMMAND] | pgcoord COMMAND --help | pgcoord --version

Commands:
%s
Global flags, before or after COMMAND:
%s
Flags and arguments may come in any order after COMMAND; "--" ends the
flags (pgcoord key -- -x hashes "-x"). A flag's value follows it, as
"--sep /" or "--sep=/"; a boolean flag takes "--json" or "--json=false".

Database: --db URL, else DATABASE_URL, else the libpq environment variables
(PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGSERVICE, PGPASSFILE,
PGSSLMODE, ...) with libpq's defaults (a Unix socket or localhost, port 5432,
the OS user). "key" and "help" need no database.

Key names: pgcoord.HashKey(NAME) is the key of NAME; with --sep, NAME is
split there into the parts of HashKey (--sep / makes "invoice/42" the key
HashKey("invoice", "42")). "pgcoord locks" and "pgcoord ui" show the names
given with --name or --names-file, those of "pgcoord demo", and those of
pgcoord's elections and semaphores, instead of numbers.

JSON: with --json (every command but demo and ui) pgcoord prints JSON Lines: one
JSON object per line (one per lock, key, election or semaphore, or per
backend with locks --waits; a single one for leader, release and
migrate), keys in snake_case, times in RFC 3339, and nothing else on
stdout. No line at all means nothing to list. An election or a semaphore
is named by "name" in every command's output.

Exit codes:
  0  success
  1  failure: the database refused or failed (including a failed connect,
     and a table of pgcoord's that another session kept locked for 5s
     while a command that reads it waited), or a refusal by pgcoord
     (release of a backend that is not pgcoord's without --force)
  2  usage: unknown command or flag, bad flag value (an empty --schema,
     say), missing, extra or empty argument (an empty election name or
     NAME), unparsable connection string
  3  nothing to show: the election has no leader ("pgcoord leader")
Messages go to stderr, prefixed "pgcoord:"; results go to stdout.
`

// printHelp writes the help of pgcoord.
func printHelp(w io.Writer) {
	var cmds strings.Builder
	tw := tabwriter.NewWriter(&cmds, 0, 0, 2, ' ', 0)
	for _, c := range commands {
		fmt.Fprintf(tw, "  %s\t%s\n", c.name, c.summary)
		if c.args != "" {
			fmt.Fprintf(tw, "  \t  pgcoord %s %s\n", c.name, c.args)
		}
	}
	tw.Flush()
	global := flag.NewFlagSet("pgcoord", flag.ContinueOnError)
	newGlobals().register(global)
	fmt.Fprintf(w, helpText, cmds.String(), flagHelp(global, nil))
}

// printCommandHelp writes the help of one command: its synopsis, its
// flags, the global flags and the exit codes.
func printCommandHelp(w io.Writer, c *command) {
	fs, _ := newFlagSet(c, newGlobals())
	global := flag.NewFlagSet("pgcoord", flag.ContinueOnError)
	newGlobals().register(global)
	own := func(f *flag.Flag) bool { return global.Lookup(f.Name) == nil }
	fmt.Fprintf(w, "Usage: pgcoord %s %s\n\n%s.\n", c.name, c.args, upperFirst(c.summary))
	if c.details != "" {
		fmt.Fprintf(w, "\n%s\n", c.details)
	}
	if s := flagHelp(fs, own); s != "" {
		fmt.Fprintf(w, "\nFlags (before or after the arguments; \"--\" ends them):\n%s", s)
	}
	fmt.Fprintf(w, "\nGlobal flags:\n%s", flagHelp(global, nil))
	if fs.Lookup("json") != nil {
		fmt.Fprint(w, "\n--json prints JSON Lines: one object per line, snake_case keys.\n")
	}
	fmt.Fprint(w, `
Exit codes: 0 success, 1 failure, 2 usage error, 3 nothing to show
(no leader); run "pgcoord help" for details.
`)
}

// flagHelp lists the flags of fs for which keep returns true (all when
// keep is nil), sorted, one entry per flag with its usage and default.
func flagHelp(fs *flag.FlagSet, keep func(*flag.Flag) bool) string {
	var flags []*flag.Flag
	fs.VisitAll(func(f *flag.Flag) {
		if keep == nil || keep(f) {
			flags = append(flags, f)
		}
	})
	sort.Slice(flags, func(i, j int) bool { return flags[i].Name < flags[j].Name })
	var b strings.Builder
	for _, f := range flags {
		arg, usage := flag.UnquoteUsage(f)
		if arg == "value" && f.Name == "name" {
			arg = "NAME"
		}
		fmt.Fprintf(&b, "  --%s", f.Name)
		if arg != "" {
			fmt.Fprintf(&b, " %s", arg)
		}
		b.WriteString("\n")
		for _, line := range strings.Split(usage, "\n") {
			fmt.Fprintf(&b, "        %s\n", line)
		}
		if def := f.DefValue; def != "" && def != "false" && def != "0" && def != "0s" && def != "[]" {
			fmt.Fprintf(&b, "        (default %s)\n", def)
		}
	}
	return b.String()
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// libpqEnv lists the environment variables that pgx reads, like libpq,
// when a connection string leaves a setting out.
var libpqEnv = []string{"PGHOST", "PGPORT", "PGDATABASE", "PGUSER", "PGPASSWORD", "PGPASSFILE",
	"PGSERVICE", "PGSERVICEFILE", "PGSSLMODE", "PGSSLCERT", "PGSSLKEY", "PGSSLROOTCERT", "PGSSLPASSWORD",
	"PGSSLSNI", "PGAPPNAME", "PGCONNECT_TIMEOUT", "PGTARGETSESSIONATTRS", "PGOPTIONS"}

// where says where the connection settings came from, and what they name,
// for error messages. cfg may be nil.
func (e *env) where(cfg *pgconn.Config) string {
	target := ""
	if cfg != nil {
		db := cfg.Database
		if db == "" {
			db = cfg.User // the server's default
		}
		target = fmt.Sprintf(": host %s, port %d, user %s, database %s", cfg.Host, cfg.Port, cfg.User, db)
	}
	if e.dbSource != "" {
		return "from " + e.dbSource + target
	}
	var set []string
	for _, v := range libpqEnv {
		if _, ok := os.LookupEnv(v); ok {
			set = append(set, v)
		}
	}
	src := "libpq's defaults (no PG* variable is set)"
	if len(set) > 0 {
		src = "the libpq environment (" + strings.Join(set, ", ") + ") and libpq's defaults"
	}
	return "no --db given and DATABASE_URL not set, so " + src + target
}

// readLockTimeout bounds how long a command that reads pgcoord's tables
// waits for a lock on one of them: another session's ALTER TABLE, VACUUM
// FULL or LOCK TABLE would otherwise hold it up unseen, for as long as
// that session likes. The connection string's lock_timeout, if it sets
// one, wins.
const readLockTimeout = 5 * time.Second

// openSchemaPool checks schema, the --schema of a command that reads
// pgcoord's tables, and opens the pool as openPool does, with
// readLockTimeout.
func openSchemaPool(ctx context.Context, e *env, schema string) (*pgxpool.Pool, error) {
	if err := checkSchema(schema); err != nil {
		return nil, err
	}
	return openPool(ctx, e, readLockTimeout)
}

// encodeLines writes vs to w as JSON, one object per line.
func encodeLines[T any](w io.Writer, vs []T) error {
	enc := json.NewEncoder(w)
	for _, v := range vs {
		if err := enc.Encode(v); err != nil {
			return err
		}
	}
	return nil
}

// openPool connects to the database, with an application name that shows
// what the connection is, within the connect timeout. A lockTimeout above
// 0 is the connections' lock_timeout, unless the connection settings set
// one.
func openPool(ctx context.Context, e *env, lockTimeout time.Duration) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.db)
	if err != nil {
		if e.dbSource == "" {
			return nil, usagef("bad connection settings (%s): %v", e.where(nil), err)
		}
		return nil, usagef("bad database URL (%s): %v", e.where(nil), err)
	}
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = cmp.Or(e.appName, "pgcoord-cli")
	}
	if _, set := cfg.ConnConfig.RuntimeParams["lock_timeout"]; !set && lockTimeout > 0 {
		cfg.ConnConfig.RuntimeParams["lock_timeout"] = strconv.FormatInt(lockTimeout.Milliseconds(), 10)
	}
	timeout := e.connectTimeout
	if !e.timeoutSet && cfg.ConnConfig.ConnectTimeout > 0 {
		timeout = cfg.ConnConfig.ConnectTimeout // the connection string's connect_timeout
	}
	cfg.ConnConfig.ConnectTimeout = timeout // every connection, including the Client's own
	connectCtx := ctx
	if timeout > 0 {
		var cancel context.CancelFunc
		connectCtx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(connectCtx); err != nil {
		pool.Close()
		// The connect timeout of pgx and connectCtx's deadline are the
		// same: either may end the connect first.
		var ne net.Error
		timedOut := connectCtx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
		if timeout > 0 && timedOut && ctx.Err() == nil {
			err = fmt.Errorf("no connection within %v (--connect-timeout): %w", timeout, err)
		}
		return nil, fmt.Errorf("connect (%s): %w", e.where(&cfg.ConnConfig.Config), err)
	}
	return pool, nil
}

// openClient opens a pool and a Client on it; close closes both.
func openClient(ctx context.Context, e *env, opts ...pgcoord.Option) (c *pgcoord.Client, closeAll func(), err error) {
	pool, err := openPool(ctx, e, 0)
	if err != nil {
		return nil, nil, err
	}
	c, err = pgcoord.New(pool, opts...)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return c, func() { _ = c.Close(context.Background()); pool.Close() }, nil
}
