package pgcoord

// After Close: every method of a Client, Session, Election and Semaphore
// that returns an error returns one wrapping ErrClosed, and touches
// nothing on the server; a closed pool is refused by New.

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// closedSurface lists, for every exported method that returns an error, a
// call of it. A method missing here fails TestClosedClientRefusesEverything,
// so a new method cannot be added without saying what it does after Close.
type closedSurface struct {
	c   *Client
	s   *Session
	e   *Election
	sem *Semaphore
	tx  pgx.Tx
}

func (f closedSurface) calls(ctx context.Context) map[string]func() error {
	k := Int64Key(7)
	fn := func(context.Context) error { return nil }
	return map[string]func() error{
		"Client.CheckFence":   func() error { return f.c.CheckFence(ctx, f.tx, k, 1) },
		"Client.Do":           func() error { return f.c.Do(ctx, k, fn) },
		"Client.Lock":         func() error { _, err := f.c.Lock(ctx, k); return err },
		"Client.LockAll":      func() error { _, err := f.c.LockAll(ctx, k, Int64Key(8)); return err },
		"Client.Locks":        func() error { _, err := f.c.Locks(ctx); return err },
		"Client.Migrate":      func() error { return f.c.Migrate(ctx) },
		"Client.NewSession":   func() error { _, err := f.c.NewSession(ctx); return err },
		"Client.RLock":        func() error { _, err := f.c.RLock(ctx, k); return err },
		"Client.Terminate":    func() error { return f.c.Terminate(ctx, 1) },
		"Client.TerminateAny": func() error { return f.c.TerminateAny(ctx, 1) },
		"Client.TryLock":      func() error { _, err := f.c.TryLock(ctx, k); return err },
		"Client.TryRLock":     func() error { _, err := f.c.TryRLock(ctx, k); return err },
		"Client.Warm":         func() error { return f.c.Warm(ctx) },

		"Session.Err":      func() error { return f.s.Err() },
		"Session.Lock":     func() error { _, err := f.s.Lock(ctx, k); return err },
		"Session.LockAll":  func() error { _, err := f.s.LockAll(ctx, k, Int64Key(8)); return err },
		"Session.RLock":    func() error { _, err := f.s.RLock(ctx, k); return err },
		"Session.TryLock":  func() error { _, err := f.s.TryLock(ctx, k); return err },
		"Session.TryRLock": func() error { _, err := f.s.TryRLock(ctx, k); return err },

		"Election.Campaign":      func() error { _, err := f.e.Campaign(ctx); return err },
		"Election.Leader":        func() error { _, err := f.e.Leader(ctx); return err },
		"Election.RequestResign": func() error { return f.e.RequestResign(ctx) },
		"Election.Run":           func() error { return f.e.Run(ctx, func(context.Context, Term) error { return nil }) },

		"Semaphore.Acquire":    func() error { _, err := f.sem.Acquire(ctx); return err },
		"Semaphore.Holders":    func() error { _, err := f.sem.Holders(ctx); return err },
		"Semaphore.Limit":      func() error { _, err := f.sem.Limit(ctx); return err },
		"Semaphore.SetLimit":   func() error { return f.sem.SetLimit(ctx, 2) },
		"Semaphore.TryAcquire": func() error { _, err := f.sem.TryAcquire(ctx); return err },
	}
}

// closeIsIdempotent names the methods that are not refused after Close: a
// second Close of a Client or of a Session returns nil, as its doc says,
// so that a deferred Close after an explicit one reports nothing.
var closeIsIdempotent = map[string]bool{"Client.Close": true, "Session.Close": true}

func TestClosedClientRefusesEverything(t *testing.T) {
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	ctx := testCtx(t)
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c, err := New(pool)
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	e := c.Election("closed-surface")
	sem := c.Semaphore("closed-surface", 1)
	if _, err := sem.Limit(ctx); err != nil { // creates the row
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	before := lockState(t, dsn)

	f := closedSurface{c: c, s: s, e: e, sem: sem, tx: tx}
	calls := f.calls(ctx)
	errType := reflect.TypeFor[error]()
	for _, v := range []any{c, s, e, sem} {
		typ := reflect.TypeOf(v)
		for i := range typ.NumMethod() {
			m := typ.Method(i)
			returnsErr := false
			for j := range m.Type.NumOut() {
				returnsErr = returnsErr || m.Type.Out(j) == errType
			}
			name := typ.Elem().Name() + "." + m.Name
			if !returnsErr || closeIsIdempotent[name] {
				continue
			}
			if _, ok := calls[name]; !ok {
				t.Errorf("%s returns an error but has no case here: add what it returns after Close", name)
			}
		}
	}
	for name, call := range calls {
		err := call()
		if !errors.Is(err, ErrClosed) {
			t.Errorf("%s after Close: got %v, want an error wrapping ErrClosed", name, err)
			continue
		}
		if msg := err.Error(); !strings.HasPrefix(msg, "pgcoord: ") || strings.Count(msg, "pgcoord:") != 1 || strings.Contains(msg, "\n") {
			t.Errorf("%s after Close: message %q: want one line starting with %q once", name, msg, "pgcoord: ")
		}
	}
	for name := range closeIsIdempotent {
		var err error
		switch name {
		case "Client.Close":
			err = c.Close(ctx)
		case "Session.Close":
			err = s.Close(ctx)
		}
		if err != nil {
			t.Errorf("%s a second time: %v, want nil", name, err)
		}
	}
	if after := lockState(t, dsn); len(after) > len(before) {
		t.Errorf("calls after Close took locks: pg_locks went from %v to %v", before, after)
	}
	// Observe returns no error: its channel delivers one LeaderInfo whose Err
	// wraps ErrClosed, and closes.
	ch := e.Observe(ctx)
	if info, open := <-ch; !open || !errors.Is(info.Err, ErrClosed) {
		t.Errorf("Observe after Close delivered %+v (open %v); want Err wrapping ErrClosed", info, open)
	}
	if _, open := <-ch; open {
		t.Error("Observe after Close: the channel stays open after its error")
	}
}

func TestNewRefusesClosedPool(t *testing.T) {
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	pool.Close()
	c, err := New(pool)
	if err == nil {
		_, lerr := c.TryLock(testCtx(t), Int64Key(9))
		_ = c.Close(context.Background())
		t.Fatalf("New on a closed pool: got a Client (TryLock: %v), want an error", lerr)
	}
	if !errors.Is(err, ErrClosed) || !strings.Contains(err.Error(), "pool") {
		t.Errorf("New on a closed pool: %v; want an error wrapping ErrClosed that names the pool", err)
	}
	notHeld(t, dsn, Int64Key(9))
}
