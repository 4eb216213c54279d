package pgcoordsql_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

// TestTypedNilArguments: a nil *sql.DB, *sql.Conn or *sql.Tx, and an
// untyped nil TxBeginner, given to any entry point of the package is
// reported as an error prefixed "pgcoord: " that names the nil argument,
// without a panic and without calling fn.
func TestTypedNilArguments(t *testing.T) {
	ctx := t.Context()
	k := pgcoord.Int64Key(1)
	fn := func(*sql.Tx) error { t.Error("fn called with a nil db"); return nil }
	var (
		nilDB   *sql.DB
		nilConn *sql.Conn
		nilTx   *sql.Tx
	)
	calls := map[string]func() error{
		"InTx(nil *sql.DB)":        func() error { return pgcoordsql.InTx(ctx, nilDB, []pgcoord.Key{k}, fn) },
		"InTx(nil *sql.Conn)":      func() error { return pgcoordsql.InTx(ctx, nilConn, []pgcoord.Key{k}, fn) },
		"InTx(nil)":                func() error { return pgcoordsql.InTx(ctx, nil, []pgcoord.Key{k}, fn) },
		"InTxOptions(nil *sql.DB)": func() error { return pgcoordsql.InTxOptions(ctx, nilDB, nil, []pgcoord.Key{k}, fn) },
		"InTxOptions(nil *sql.Conn)": func() error {
			return pgcoordsql.InTxOptions(ctx, nilConn, &sql.TxOptions{ReadOnly: true}, []pgcoord.Key{k}, fn)
		},
		"XactLock(nil *sql.Tx)":           func() error { return pgcoordsql.XactLock(ctx, nilTx, k) },
		"XactRLock(nil *sql.Tx)":          func() error { return pgcoordsql.XactRLock(ctx, nilTx, k) },
		"XactTryLock(nil *sql.Tx)":        func() error { return pgcoordsql.XactTryLock(ctx, nilTx, k) },
		"XactTryRLock(nil *sql.Tx)":       func() error { return pgcoordsql.XactTryRLock(ctx, nilTx, k) },
		"CheckFence(nil *sql.Tx)":         func() error { return pgcoordsql.CheckFence(ctx, nilTx, k, 1) },
		"XactLock(nil *sql.Tx, done ctx)": func() error { c, cancel := context.WithCancel(ctx); cancel(); return pgcoordsql.XactLock(c, nilTx, k) },
	}
	for name, call := range calls {
		err := noPanic(t, name, call)
		if err == nil || !strings.HasPrefix(err.Error(), "pgcoord: ") || !strings.Contains(err.Error(), "nil") {
			t.Errorf("%s: got %v, want a pgcoord error about the nil argument", name, err)
		}
	}
}

// noPanic runs f and returns its error, or fails the test if f panics.
func noPanic(t *testing.T, what string, f func() error) (err error) {
	t.Helper()
	defer func() {
		if p := recover(); p != nil {
			t.Errorf("%s panicked: %v", what, p)
		}
	}()
	return f()
}
