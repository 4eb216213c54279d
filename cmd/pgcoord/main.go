// Command pgcoord is the operator's view of pgcoord's advisory locks: who
// holds and who waits for which key, how a name maps to a key in pg_locks,
// how to force-release a stuck lock, and how to apply pgcoord's migrations.
//
// Usage:
//
//	pgcoord [--db URL] COMMAND [FLAGS] [ARGS]
//
// Run "pgcoord help" for the commands, their flags and the exit codes.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"

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

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// env is what a command runs with.
type env struct {
	db     string // connection string, from --db or DATABASE_URL
	stdout io.Writer
	stderr io.Writer
}

// A command is one subcommand. flags declares its flags on fs; run runs it
// with the arguments left after the flags.
type command struct {
	name    string
	args    string // synopsis of the arguments, for the help text
	summary string
	needsDB bool
	flags   func(fs *flag.FlagSet) func(ctx context.Context, e *env, args []string) error
}

// commands lists the subcommands in the order the help text shows them.
// A new subcommand is one more entry here.
var commands = []command{
	{name: "locks", args: "[--json] [--name NAME]... [--sep SEP]", needsDB: true, flags: locksCmd,
		summary: "list the advisory locks of the database: holders and waiters, by key or name"},
	{name: "key", args: "[--sep SEP] NAME...", flags: keyCmd,
		summary: "print HashKey(NAME) and the classid/objid/objsubid it has in pg_locks"},
	{name: "release", args: "--pid N [--force] [--app NAME]", needsDB: true, flags: releaseCmd,
		summary: "force-release the locks of a backend by terminating it"},
	{name: "leader", args: "[--schema NAME] [--json] [--resign] ELECTION", needsDB: true, flags: leaderCmd,
		summary: "show who leads an election (identity, term, since, backend pid); --resign asks it to step down"},
	{name: "semaphores", args: "[--schema NAME] [--json] [--holders]", needsDB: true, flags: semaphoresCmd,
		summary: "list the semaphores: limit, permits held, processes queued; --holders lists each holder"},
	{name: "migrate", args: "[--schema NAME]", needsDB: true, flags: migrateCmd,
		summary: "create or update pgcoord's tables (fences) in a schema"},
	{name: "demo", args: "", needsDB: true, flags: demoCmd,
		summary: "take a few locks and hold them until interrupted, for 'pgcoord locks' to show"},
}

// usageError is a mistake in the command line: exit code 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

// run runs the command line args and returns the exit code. ctx ends the
// command (the demo runs until it is done).
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	global := flag.NewFlagSet("pgcoord", flag.ContinueOnError)
	global.SetOutput(io.Discard)
	db := global.String("db", "", "")
	if err := global.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printHelp(stdout)
			return exitOK
		}
		return fail(stderr, usagef("%v", err))
	}
	args = global.Args()
	if len(args) == 0 {
		printHelp(stderr)
		return exitUsage
	}
	if args[0] == "help" {
		printHelp(stdout)
		return exitOK
	}
	var cmd *command
	for i := range commands {
		if commands[i].name == args[0] {
			cmd = &commands[i]
		}
	}
	if cmd == nil {
		return fail(stderr, usagef("unknown command %q; run \"pgcoord help\"", args[0]))
	}
	fs := flag.NewFlagSet("pgcoord "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(db, "db", *db, "")
	runCmd := cmd.flags(fs)
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printCommandHelp(stdout, cmd, fs)
			return exitOK
		}
		return fail(stderr, usagef("%s: %v", cmd.name, err))
	}
	e := &env{db: *db, stdout: stdout, stderr: stderr}
	if e.db == "" {
		e.db = getenv("DATABASE_URL")
	}
	if cmd.needsDB && e.db == "" {
		return fail(stderr, usagef("%s: no database: set DATABASE_URL or pass --db URL", cmd.name))
	}
	return fail(stderr, runCmd(ctx, e, fs.Args()))
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
	}
	fmt.Fprintln(stderr, "pgcoord:", strings.TrimPrefix(err.Error(), "pgcoord: "))
	return exitFailure
}

const helpText = `pgcoord: inspect and manage pgcoord's PostgreSQL advisory locks.

Usage:
  pgcoord [--db URL] COMMAND [FLAGS] [ARGS]
  pgcoord help | pgcoord COMMAND -h

The database is --db URL (before or after COMMAND), else DATABASE_URL.

Commands:
%s
Key names: pgcoord.HashKey(NAME) is the key of NAME; with --sep, NAME is
split there into the parts of HashKey (--sep / makes "invoice/42" the key
HashKey("invoice", "42")). "pgcoord locks" shows the names given with
--name, and those of "pgcoord demo", instead of numbers.

Exit codes:
  0  success
  1  failure: the database refused or failed, or a refusal by pgcoord
     (release of a backend that is not pgcoord's without --force)
  2  usage: unknown command or flag, missing argument, no database given
  3  nothing to show: the election has no leader ("pgcoord leader")
Messages go to stderr, prefixed "pgcoord:"; results go to stdout.
`

func printHelp(w io.Writer) {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	for _, c := range commands {
		fmt.Fprintf(tw, "  %s %s\t%s\n", c.name, c.args, c.summary)
	}
	tw.Flush()
	fmt.Fprintf(w, helpText, b.String())
}

func printCommandHelp(w io.Writer, c *command, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: pgcoord %s %s\n\n%s.\n\nFlags:\n", c.name, c.args, c.summary)
	fs.SetOutput(w)
	fs.PrintDefaults()
}

// openPool connects to the database, with an application name that shows
// what the connection is.
func openPool(ctx context.Context, e *env) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.db)
	if err != nil {
		return nil, usagef("bad database URL: %v", err)
	}
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = "pgcoord-cli"
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect: %w", err)
	}
	return pool, nil
}

// openClient opens a pool and a Client on it; close closes both.
func openClient(ctx context.Context, e *env, opts ...pgcoord.Option) (c *pgcoord.Client, closeAll func(), err error) {
	pool, err := openPool(ctx, e)
	if err != nil {
		return nil, nil, err
	}
	c, err = pgcoord.New(pool, opts...)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return c, func() { _ = c.Close(); pool.Close() }, nil
}
