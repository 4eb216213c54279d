package pgcoordtest_test

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
)

// runTest runs test as the test runner would run a Test function, so that
// an example can show a whole test: with a testing.TB whose Cleanup
// functions run when test returns, and whose Fatal and Skip stop it. It
// prints what the test reported, and FAIL if it failed.
func runTest(name string, test func(t testing.TB)) {
	t := &exampleT{name: name}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer t.cleanup()
		test(t)
	}()
	<-done
	if t.failed {
		fmt.Println("FAIL")
	}
}

// exampleT is the part of testing.TB that tests use, for runTest. The
// methods it does not define panic through the nil embedded interface.
type exampleT struct {
	testing.TB
	name string

	mu       sync.Mutex
	failed   bool
	skipped  bool
	cleanups []func()
}

func (t *exampleT) Name() string { return t.name }
func (t *exampleT) Helper()      {}
func (t *exampleT) Cleanup(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cleanups = append(t.cleanups, f)
}
func (t *exampleT) cleanup() {
	for {
		t.mu.Lock()
		if len(t.cleanups) == 0 {
			t.mu.Unlock()
			return
		}
		f := t.cleanups[len(t.cleanups)-1]
		t.cleanups = t.cleanups[:len(t.cleanups)-1]
		t.mu.Unlock()
		f()
	}
}
func (t *exampleT) Failed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.failed
}
func (t *exampleT) Log(args ...any)                 { fmt.Println(args...) }
func (t *exampleT) Logf(format string, args ...any) { fmt.Printf(format+"\n", args...) }
func (t *exampleT) Error(args ...any)               { t.fail(); t.Log(args...) }
func (t *exampleT) Errorf(format string, args ...any) {
	t.fail()
	t.Logf(format, args...)
}
func (t *exampleT) Fatal(args ...any) { t.Error(args...); runtime.Goexit() }
func (t *exampleT) Fatalf(format string, args ...any) {
	t.Errorf(format, args...)
	runtime.Goexit()
}
func (t *exampleT) Skip(args ...any) { t.skipped = true; t.Log(args...); runtime.Goexit() }
func (t *exampleT) Skipf(format string, args ...any) {
	t.skipped = true
	t.Logf(format, args...)
	runtime.Goexit()
}
func (t *exampleT) fail() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.failed = true
}
