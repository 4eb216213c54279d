package pgcoordsql_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

// inTxDB returns a fresh database with a table t(v int) and a *sql.DB on it.
func inTxDB(t *testing.T) (string, *sql.DB) {
	t.Helper()
	dsn := pgtest.DB(t)
	db := openDB(t, dsn)
	if _, err := db.Exec("CREATE TABLE t (v int)"); err != nil {
		t.Fatal(err)
	}
	return dsn, db
}

// rows returns the values in table t.
func rows(t *testing.T, db *sql.DB) []int {
	t.Helper()
	rs, err := db.Query("SELECT v FROM t ORDER BY v")
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	var out []int
	for rs.Next() {
		var v int
		if err := rs.Scan(&v); err != nil {
			t.Fatal(err)
		}
		out = append(out, v)
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// txPid returns the backend pid of tx.
func txPid(t *testing.T, tx *sql.Tx) int32 {
	ctx := t.Context()
	t.Helper()
	var pid int32
	if err := tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// TestInTx: InTx holds the keys (canonical order, exclusive) while fn runs
// and commits fn's work; on fn's error or panic it rolls back, returns the
// error or re-raises the panic; an ignored statement error turns COMMIT
// into ROLLBACK and an error. In every case no key is held afterwards and
// no connection is in use.
func TestInTx(t *testing.T) {
	ctx := t.Context()
	dsn, db := inTxDB(t)
	keys := []pgcoord.Key{pgcoord.PairKey(1, 1), pgcoord.Int64Key(7), pgcoord.Int64Key(-7)}
	sorted := []pgcoord.Key{pgcoord.Int64Key(-7), pgcoord.Int64Key(7), pgcoord.PairKey(1, 1)}
	var pid int32
	after := func(t *testing.T, wantRows ...int) {
		t.Helper()
		if got := locksOf(t, dsn, pid); len(got) != 0 {
			t.Fatalf("keys still held after InTx returned: %q", got)
		}
		if got := rows(t, db); len(got) != len(wantRows) || (len(got) > 0 && got[0] != wantRows[0]) {
			t.Fatalf("rows %v, want %v", got, wantRows)
		}
		idle(t, db)
	}

	t.Run("commit", func(t *testing.T) {
		err := pgcoordsql.InTx(ctx, db, keys, func(tx *sql.Tx) error {
			pid = txPid(t, tx)
			waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", sorted...))
			_, err := tx.ExecContext(ctx, "INSERT INTO t VALUES (1)")
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		after(t, 1)
	})
	if _, err := db.Exec("DELETE FROM t"); err != nil {
		t.Fatal(err)
	}

	t.Run("error", func(t *testing.T) {
		boom := errors.New("boom")
		err := pgcoordsql.InTx(ctx, db, keys, func(tx *sql.Tx) error {
			pid = txPid(t, tx)
			if _, err := tx.ExecContext(ctx, "INSERT INTO t VALUES (2)"); err != nil {
				return err
			}
			return boom
		})
		if err != boom {
			t.Fatalf("got %v, want fn's error unchanged", err)
		}
		after(t)
	})

	t.Run("panic", func(t *testing.T) {
		var recovered any
		func() {
			defer func() { recovered = recover() }()
			_ = pgcoordsql.InTx(ctx, db, keys, func(tx *sql.Tx) error {
				pid = txPid(t, tx)
				if _, err := tx.ExecContext(ctx, "INSERT INTO t VALUES (3)"); err != nil {
					return err
				}
				panic("fn panicked")
			})
		}()
		if recovered != "fn panicked" {
			t.Fatalf("recovered %v, want fn's panic", recovered)
		}
		after(t)
	})

	t.Run("ignored error", func(t *testing.T) {
		err := pgcoordsql.InTx(ctx, db, keys, func(tx *sql.Tx) error {
			pid = txPid(t, tx)
			if _, err := tx.ExecContext(ctx, "INSERT INTO t VALUES (4)"); err != nil {
				return err
			}
			_, _ = tx.ExecContext(ctx, "SELECT 1/0") // ignored: aborts the transaction
			return nil
		})
		if !errors.Is(err, pgx.ErrTxCommitRollback) {
			t.Fatalf("got %v, want an error wrapping pgx.ErrTxCommitRollback", err)
		}
		after(t)
	})

	t.Run("sql.Conn and options", func(t *testing.T) {
		conn, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		err = pgcoordsql.InTxOptions(ctx, conn, &sql.TxOptions{ReadOnly: true}, keys, func(tx *sql.Tx) error {
			pid = txPid(t, tx)
			waitLocks(t, dsn, pid, want("ExclusiveLock", "granted", sorted...))
			var ro string
			if err := tx.QueryRowContext(ctx, "SHOW transaction_read_only").Scan(&ro); err != nil {
				return err
			}
			if ro != "on" {
				t.Errorf("transaction_read_only = %s, want on", ro)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if got := locksOf(t, dsn, pid); len(got) != 0 {
			t.Fatalf("keys still held after InTxOptions returned: %q", got)
		}
	})
}

// TestInTxCancelledWait: InTx waiting for a held key until its ctx's
// deadline returns the context's error without calling fn, holds nothing
// afterwards, and leaves no connection in use.
func TestInTxCancelledWait(t *testing.T) {
	ctx := t.Context()
	dsn, db := inTxDB(t)
	k := pgcoord.Int64Key(1)
	holder, holderPid := begin(t, db)
	if err := pgcoordsql.XactLock(ctx, holder, k); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	called := false
	r := async(func() error {
		return pgcoordsql.InTx(cctx, db, []pgcoord.Key{k}, func(*sql.Tx) error { called = true; return nil })
	})
	// Wait until some backend other than the holder waits for k.
	pgtest.Eventually(t, waitLimit, "InTx to wait for the key", func() bool {
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if l.PID != holderPid && !l.Granted {
				return true
			}
		}
		return false
	})
	cancel()
	if err := r.get(t); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want an error wrapping context.Canceled", err)
	}
	if called {
		t.Fatal("fn was called without the key")
	}
	pgtest.Eventually(t, waitLimit, "only the holder to hold advisory locks", func() bool {
		for _, l := range pgtest.AdvisoryLocks(t, dsn) {
			if l.PID != holderPid {
				return false
			}
		}
		return true
	})
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}
	idle(t, db)
}

// TestInTxBadInput: invalid keys, a nil db, a nil fn and a nil ctx are
// reported before BEGIN, as errors, not panics.
func TestInTxBadInput(t *testing.T) {
	ctx := t.Context()
	_, db := inTxDB(t)
	fn := func(*sql.Tx) error { t.Error("fn called"); return nil }
	if err := pgcoordsql.InTx(ctx, db, []pgcoord.Key{{}}, fn); !errors.Is(err, pgcoord.ErrInvalidKey) {
		t.Errorf("zero key: got %v, want ErrInvalidKey", err)
	}
	var nilDB *sql.DB
	if err := pgcoordsql.InTx(ctx, nilDB, []pgcoord.Key{pgcoord.Int64Key(1)}, fn); err == nil {
		t.Error("nil *sql.DB: no error")
	}
	if err := pgcoordsql.InTxOptions(ctx, nil, nil, []pgcoord.Key{pgcoord.Int64Key(1)}, fn); err == nil {
		t.Error("nil TxBeginner: no error")
	}
	if err := pgcoordsql.InTx(ctx, db, []pgcoord.Key{pgcoord.Int64Key(1)}, nil); err == nil {
		t.Error("nil fn: no error")
	}
	var nilCtx context.Context
	if err := noPanic(t, "InTx(nil ctx)", func() error { return pgcoordsql.InTx(nilCtx, db, []pgcoord.Key{pgcoord.Int64Key(1)}, fn) }); err == nil || err.Error() != "pgcoord: in tx int64:1: ctx is nil" {
		t.Errorf("nil ctx: got %v", err)
	}
	if n := db.Stats().OpenConnections; n != 1 { // the one inTxDB used
		t.Errorf("%d connections open, want 1: bad input began a transaction", n)
	}
}
