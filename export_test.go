package pgcoord

import (
	"fmt"
	"os"
	"sync"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// DatabaseURLForExample returns the connection string of a fresh database for
// one runnable example (package pgcoord_test), which has no *testing.T to
// pass to pgtest.DB. The databases are dropped after every test and
// example of the binary has run.
func DatabaseURLForExample(name string) string {
	return pgtest.DB(&exampleT{name: name})
}

// exampleT is the part of testing.TB that pgtest.DB uses. The embedded
// interface is nil: any other method panics.
type exampleT struct {
	testing.TB
	name string
}

var exampleCleanups struct {
	sync.Mutex
	fs []func()
}

func (e *exampleT) Helper()      {}
func (e *exampleT) Name() string { return e.name }
func (e *exampleT) Cleanup(f func()) {
	exampleCleanups.Lock()
	defer exampleCleanups.Unlock()
	exampleCleanups.fs = append(exampleCleanups.fs, f)
}
func (e *exampleT) Fatal(args ...any)                 { panic(fmt.Sprint(args...)) }
func (e *exampleT) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (e *exampleT) Errorf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "example %s: %s\n", e.name, fmt.Sprintf(format, args...))
}

// runExampleCleanups drops the examples' databases, newest first.
func runExampleCleanups() {
	exampleCleanups.Lock()
	fs := exampleCleanups.fs
	exampleCleanups.fs = nil
	exampleCleanups.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}

// lockBackendPID returns the pid of the backend that holds l, as pg_locks
// shows it, for tests that compare a Lock with pg_locks.
func lockBackendPID(l *core.Lock) int32 { return l.S.PID() }

// gateWaiters returns how many goroutines of c wait at the in-process gate
// of k.
func gateWaiters(c *Client, k Key) int {
	c.core.Gates.Mu.Lock()
	defer c.core.Gates.Mu.Unlock()
	if g := c.core.Gates.M[k.coreKey()]; g != nil {
		return len(g.Queue)
	}
	return 0
}

// gatePassedExclusive reports whether a goroutine of c has passed the
// in-process gate of k for an exclusive hold.
func gatePassedExclusive(c *Client, k Key) bool {
	c.core.Gates.Mu.Lock()
	defer c.core.Gates.Mu.Unlock()
	g := c.core.Gates.M[k.coreKey()]
	return g != nil && g.Writer
}
