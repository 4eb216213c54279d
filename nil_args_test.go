package pgcoord

// Nil arguments: every method that takes a ctx refuses a nil one with an
// error that says so (the calls that release something take it as
// context.Background, so that nothing stays held), and nil callbacks are
// refused before anything is locked. None of them panics.

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// nilCtx is the nil ctx the tests pass on purpose.
var nilCtx context.Context

// releasesWithNilCtx names the methods that take a nil ctx as
// context.Background: they release what is held, which must not fail for
// want of a ctx.
var releasesWithNilCtx = map[string]bool{
	"Client.Close": true, "Session.Close": true, "Lock.Unlock": true,
	"Permit.Release": true, "Leadership.Resign": true,
}

// nilCtxArgs builds the arguments of m after its receiver: a nil ctx and
// valid values for the rest, so that only the ctx is wrong.
func nilCtxArgs(t *testing.T, m reflect.Method, tx pgx.Tx) []reflect.Value {
	t.Helper()
	ft := m.Type
	var args []reflect.Value
	for i := 1; i < ft.NumIn(); i++ {
		pt := ft.In(i)
		if ft.IsVariadic() && i == ft.NumIn()-1 {
			break
		}
		switch {
		case pt == reflect.TypeFor[context.Context]():
			args = append(args, reflect.Zero(pt))
		case pt == reflect.TypeFor[Key]():
			args = append(args, reflect.ValueOf(Int64Key(4242)))
		case pt == reflect.TypeFor[pgx.Tx]():
			args = append(args, reflect.ValueOf(tx))
		case pt.Kind() == reflect.Func:
			args = append(args, reflect.MakeFunc(pt, func([]reflect.Value) []reflect.Value {
				out := make([]reflect.Value, pt.NumOut())
				for j := range out {
					out[j] = reflect.Zero(pt.Out(j))
				}
				return out
			}))
		case pt.Kind() == reflect.Int || pt.Kind() == reflect.Int32 || pt.Kind() == reflect.Int64:
			args = append(args, reflect.ValueOf(1).Convert(pt))
		default:
			t.Fatalf("%s: no value for parameter %d of type %v: teach nilCtxArgs", m.Name, i, pt)
		}
	}
	return args
}

// errorOrPanic returns call's error, or an error naming the panic it raised.
func errorOrPanic(call func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return call()
}

// callNilCtx calls m on recv with a nil ctx and returns the error it
// reports (through its error result, or the Err of what it delivers), or
// the panic it raised.
func callNilCtx(t *testing.T, recv reflect.Value, m reflect.Method, tx pgx.Tx) (panicked any, err error) {
	defer func() { panicked = recover() }()
	out := recv.Method(m.Index).Call(nilCtxArgs(t, m, tx))
	for _, o := range out {
		switch v := o.Interface().(type) {
		case error:
			return nil, v
		case <-chan LeaderInfo:
			info := <-v
			return nil, info.Err
		}
	}
	return nil, nil
}

func TestNilCtxRefused(t *testing.T) {
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	ctx := testCtx(t)
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c := newTestClientOn(t, pool)
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	e := c.Election("nil-ctx")
	sem := c.Semaphore("nil-ctx", 1)

	ctxType := reflect.TypeFor[context.Context]()
	checked := 0
	for _, recv := range []any{c, s, e, sem} {
		rv := reflect.ValueOf(recv)
		typ := rv.Type()
		for i := range typ.NumMethod() {
			m := typ.Method(i)
			name := typ.Elem().Name() + "." + m.Name
			if m.Type.NumIn() < 2 || m.Type.In(1) != ctxType || releasesWithNilCtx[name] {
				continue
			}
			checked++
			p, err := callNilCtx(t, rv, m, tx)
			switch {
			case p != nil:
				t.Errorf("%s(nil ctx) panicked: %v", name, p)
			case err == nil || !strings.Contains(err.Error(), "ctx is nil"):
				t.Errorf("%s(nil ctx) = %v; want an error saying ctx is nil", name, err)
			case !strings.HasPrefix(err.Error(), "pgcoord: ") || strings.Count(err.Error(), "pgcoord:") != 1:
				t.Errorf("%s(nil ctx): %q; want one \"pgcoord: \" prefix", name, err)
			}
		}
	}
	if checked < 25 {
		t.Errorf("checked %d methods that take a ctx, want at least 25: the reflection missed some", checked)
	}
	if n := len(lockState(t, dsn)); n != 0 {
		t.Errorf("calls with a nil ctx left %d keys in pg_locks", n)
	}
	// The package functions that take a ctx.
	for name, call := range map[string]func() error{
		"Migrate":    func() error { return Migrate(nilCtx, pool) },
		"CheckFence": func() error { return CheckFence(nilCtx, tx, Int64Key(1), 1) },
	} {
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Errorf("%s(nil ctx) panicked: %v", name, p)
				}
			}()
			if err := call(); err == nil || !strings.Contains(err.Error(), "ctx is nil") {
				t.Errorf("%s(nil ctx) = %v; want an error saying ctx is nil", name, err)
			}
		}()
	}
}

func TestReleasesTakeNilCtxAsBackground(t *testing.T) {
	dsn := pgtest.DB(t)
	pool := pgtest.Pool(t, dsn)
	ctx := testCtx(t)
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	c := newTestClientOn(t, pool)
	k := Int64Key(4343)
	l, err := c.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Unlock(nilCtx); err != nil {
		t.Errorf("Unlock(nil) = %v, want nil", err)
	}
	notHeld(t, dsn, k)

	p, err := c.Semaphore("nil-release", 1).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Release(nilCtx); err != nil {
		t.Errorf("Permit.Release(nil) = %v, want nil", err)
	}
	ld, err := c.Election("nil-resign").Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ld.Resign(nilCtx); err != nil {
		t.Errorf("Leadership.Resign(nil) = %v, want nil", err)
	}
	s, err := c.NewSession(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Lock(ctx, k); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(nilCtx); err != nil {
		t.Errorf("Session.Close(nil) = %v, want nil", err)
	}
	notHeld(t, dsn, k)
	if err := c.Close(nilCtx); err != nil {
		t.Errorf("Client.Close(nil) = %v, want nil", err)
	}
	if n := len(lockState(t, dsn)); n != 0 {
		t.Errorf("after Close(nil), pg_locks still shows %d keys", n)
	}
}

func TestNilCallbacksRefusedBeforeLocking(t *testing.T) {
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	ctx := testCtx(t)
	k := Int64Key(4444)
	for name, call := range map[string]func() error{
		"Do":  func() error { return c.Do(ctx, k, nil) },
		"Run": func() error { return c.Election("nil-fn").Run(ctx, nil) },
	} {
		err := errorOrPanic(call)
		if err == nil || !strings.Contains(err.Error(), "fn is nil") || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s with a nil fn = %v; want an error saying fn is nil", name, err)
		}
	}
	notHeld(t, dsn, k)
	if n := len(lockState(t, dsn)); n != 0 {
		t.Errorf("nil callbacks left %d keys in pg_locks", n)
	}
}

// A nil Client refuses a nil ctx with the same error as any Client, and a
// Session or Client that NewSession, New or Open did not make (the zero
// value) answers what it always did: its methods that read no
// connection do not panic.
func TestNilAndZeroReceivers(t *testing.T) {
	var c *Client
	k := Int64Key(1)
	for name, call := range map[string]func() error{
		"Lock":       func() error { _, err := c.Lock(nilCtx, k); return err },
		"TryLock":    func() error { _, err := c.TryLock(nilCtx, k); return err },
		"RLock":      func() error { _, err := c.RLock(nilCtx, k); return err },
		"TryRLock":   func() error { _, err := c.TryRLock(nilCtx, k); return err },
		"LockAll":    func() error { _, err := c.LockAll(nilCtx, k); return err },
		"NewSession": func() error { _, err := c.NewSession(nilCtx); return err },
		"Do":         func() error { return c.Do(nilCtx, k, func(context.Context) error { return nil }) },
	} {
		err := errorOrPanic(call)
		if err == nil || !strings.Contains(err.Error(), "ctx is nil") {
			t.Errorf("nil Client: %s(nil ctx) = %v; want an error saying ctx is nil", name, err)
		}
	}
	var s Session
	if s.Err() != nil || s.PID() != 0 || s.Done() != nil {
		t.Errorf("zero Session: Err %v, PID %d, Done %v; want nil, 0, nil", s.Err(), s.PID(), s.Done())
	}
	var zc Client
	if st := zc.Stat(); st != (Stat{}) {
		t.Errorf("zero Client: Stat() = %+v, want the zero Stat", st)
	}
	if err := zc.CheckFence(context.Background(), nil, k, 1); err == nil || !strings.Contains(err.Error(), "nil pgx.Tx") {
		t.Errorf("zero Client: CheckFence with a nil tx = %v; want an error naming the nil pgx.Tx", err)
	}
	if err := c.Do(context.Background(), Key{}, nil); err == nil || err.Error() != "pgcoord: do Key{}: fn is nil" {
		t.Errorf("Do with the zero Key and a nil fn = %v; want pgcoord: do Key{}: fn is nil", err)
	}
}
