package pgcoord

import (
	"fmt"
	"os"
	"testing"

	"github.com/pgcoord/pgcoord/internal/pgtest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(faultChildEnv); role != "" {
		os.Exit(faultChildMain(role)) // a child process of the fault tests
	}
	pgtest.Main(leakChecked{m})
}

// leakChecked runs the tests and then fails the run if any goroutine they
// started is still alive: every Client, Session and Lock must have cleaned
// up after itself by the time its test returned.
type leakChecked struct{ m *testing.M }

func (l leakChecked) Run() int {
	setExampleDB()
	code := l.m.Run()
	runExampleCleanups()
	pgtest.ReportSkips() // the tests that skipped, and why, even without -v
	if code != 0 {
		return code
	}
	if err := goleak.Find(goleak.IgnoreAnyFunction("github.com/pgcoord/pgcoord/internal/pgtest.startChild.func1")); err != nil {
		fmt.Fprintln(os.Stderr, "goroutine leak after all tests:", err)
		return 1
	}
	return code
}
