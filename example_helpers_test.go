package pgcoord_test

import "github.com/pgcoord/pgcoord"

// databaseURL returns the connection string of a fresh database for the
// example called name; in a program it would be the application's own,
// such as os.Getenv("DATABASE_URL").
func databaseURL(name string) string { return pgcoord.DatabaseURLForExample(name) }
