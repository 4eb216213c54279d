package pgcoordsql_test

import (
	"database/sql"
	"fmt"
	"os"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { pgtest.Main(run{m}) }

// run sets up the examples' database, runs the tests and examples, and
// fails the run if a goroutine they started is still alive.
type run struct{ m *testing.M }

func (r run) Run() int {
	cleanup := setExampleDB()
	code := r.m.Run()
	cleanup()
	if code != 0 {
		return code
	}
	if err := goleak.Find(goleak.IgnoreAnyFunction("github.com/pgcoord/pgcoord/internal/pgtest.startChild.func1")); err != nil {
		fmt.Fprintln(os.Stderr, "goroutine leak after all tests:", err)
		return 1
	}
	return code
}

// setExampleDB points DATABASE_URL, which the examples read as a program
// would, at a fresh database of the test server holding the examples'
// table, whatever the variable held. It returns what drops the database.
func setExampleDB() (cleanup func()) {
	t := &exampleT{}
	defer func() {
		if r := recover(); r != nil { // no server: the tests say why
			fmt.Fprintln(os.Stderr, "pgcoordsql: no database for the examples:", r)
		}
	}()
	dsn := pgtest.DB(t)
	os.Setenv("DATABASE_URL", dsn)
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		panic(err)
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE accounts (id text PRIMARY KEY, balance int NOT NULL)`); err != nil {
		panic(err)
	}
	return t.cleanup
}

// resetAccounts sets the examples' accounts to alice 100, bob 0.
func resetAccounts() {
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	if _, err := db.Exec(`DELETE FROM accounts; INSERT INTO accounts VALUES ('alice', 100), ('bob', 0)`); err != nil {
		panic(err)
	}
}

// exampleT is the part of testing.TB that pgtest.DB uses outside a test;
// any other method panics (the embedded interface is nil).
type exampleT struct {
	testing.TB
	fs []func()
}

func (e *exampleT) Helper()                           {}
func (e *exampleT) Name() string                      { return "Examples" }
func (e *exampleT) Cleanup(f func())                  { e.fs = append(e.fs, f) }
func (e *exampleT) Fatal(args ...any)                 { panic(fmt.Sprint(args...)) }
func (e *exampleT) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (e *exampleT) Errorf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "examples: %s\n", fmt.Sprintf(format, args...))
}

func (e *exampleT) cleanup() {
	for i := len(e.fs) - 1; i >= 0; i-- {
		e.fs[i]()
	}
}
