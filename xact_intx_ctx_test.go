package pgcoord

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestInTxCtxEndsAfterFn: InTx begun on a *pgx.Conn (not nested) whose ctx
// ends after fn wrote a row and returned nil, before COMMIT, under both of
// pgx's context handlers: COMMIT is not sent, InTx returns an error
// wrapping context.Canceled, fn's row is never committed, and the key is
// released (pg_locks shows nothing for the backend, another transaction
// takes the key).
func TestInTxCtxEndsAfterFn(t *testing.T) {
	dsn, pool := xactPool(t)
	ctx := t.Context()
	if _, err := pool.Exec(ctx, "CREATE TABLE t (v text)"); err != nil {
		t.Fatal(err)
	}
	k := Int64Key(7)
	for _, h := range xactCancelHandlers {
		t.Run(h.name, func(t *testing.T) {
			conn := xactCancelConn(t, dsn, h.configure)
			pid := int32(conn.PgConn().PID())
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			err := InTx(cctx, conn, []Key{k}, func(tx pgx.Tx) error {
				if _, err := tx.Exec(cctx, "INSERT INTO t VALUES ($1)", h.name); err != nil {
					return err
				}
				xactWantHeld(t, dsn, pid, xactEx(k))
				cancel()
				return nil
			})
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("InTx whose ctx ended after fn: got %v, want an error wrapping context.Canceled", err)
			}
			t.Logf("InTx: %v", err)
			xactEventuallyHeld(t, dsn, pid)
			xactNestedKeyFree(t, pool, k)
			var n int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM t WHERE v = $1", h.name).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				t.Fatalf("fn's row was committed although InTx returned %v", err)
			}
		})
	}
}
