package pgcoordtest

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord"
)

// BenchmarkDBMigratedEachTime is what BenchmarkDB would cost without the
// template: an empty database (from template0), pgcoord.Migrate on it,
// and the drop.
func BenchmarkDBMigratedEachTime(b *testing.B) {
	DB(b) // the server
	s, err := sharedServer(shared.cfg)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	i := 0
	for b.Loop() {
		i++
		name := fmt.Sprintf("%sbench_%d", s.prefix, i)
		if err := s.found.CreateDB(name, ""); err != nil {
			b.Fatal(err)
		}
		conn, err := pgx.Connect(ctx, s.found.ConnString(name))
		if err != nil {
			b.Fatal(err)
		}
		if err := pgcoord.Migrate(ctx, conn); err != nil {
			b.Fatal(err)
		}
		if err := conn.Close(ctx); err != nil {
			b.Fatal(err)
		}
		if err := s.found.DropDB(name); err != nil {
			b.Fatal(err)
		}
	}
}
