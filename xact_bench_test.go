package pgcoord

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// BenchmarkInTx compares InTx with two keys against the floor it is built
// on, done with plain pgx on the same pool in the same run: BEGIN; one
// statement taking both keys; COMMIT.
func BenchmarkInTx(b *testing.B) {
	pool := pgtest.Pool(b, pgtest.DB(b))
	ctx := context.Background()
	keys := []Key{Int64Key(2), Int64Key(1)}
	nop := func(pgx.Tx) error { return nil }

	b.Run("InTx", func(b *testing.B) {
		for b.Loop() {
			if err := InTx(ctx, pool, keys, nop); err != nil {
				b.Fatal(err)
			}
		}
	})

	b.Run("raw_pgx", func(b *testing.B) {
		const lock = "SELECT pg_advisory_xact_lock($1::int8), pg_advisory_xact_lock($2::int8)"
		for b.Loop() {
			tx, err := pool.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := tx.Exec(ctx, lock, int64(1), int64(2)); err != nil {
				b.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
}
