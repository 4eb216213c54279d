package pgcoordsql_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"

	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/pgcoordsql"
)

// A transfer between two accounts, on a *sql.DB from pgx's stdlib driver:
// both accounts are locked, in the canonical order, for exactly the life of
// the transaction.
func ExampleInTx() {
	resetAccounts() // alice 100, bob 0, whichever run this is
	// snippet:start
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()

	ctx := context.Background()
	from, to := pgcoord.HashKey("account", "alice"), pgcoord.HashKey("account", "bob")
	err = pgcoordsql.InTx(ctx, db, []pgcoord.Key{from, to}, func(tx *sql.Tx) error {
		// Locked until COMMIT or ROLLBACK; return every error, never ignore one.
		if _, err := tx.ExecContext(ctx, "UPDATE accounts SET balance = balance - 10 WHERE id = 'alice'"); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, "UPDATE accounts SET balance = balance + 10 WHERE id = 'bob'")
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	// snippet:end

	var alice, bob int
	if err := db.QueryRowContext(ctx, "SELECT (SELECT balance FROM accounts WHERE id = 'alice'), (SELECT balance FROM accounts WHERE id = 'bob')").Scan(&alice, &bob); err != nil {
		log.Fatal(err)
	}
	fmt.Println("alice:", alice, "bob:", bob)
	// Output: alice: 90 bob: 10
}
