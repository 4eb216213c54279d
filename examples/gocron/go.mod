module github.com/pgcoord/pgcoord/examples/gocron

go 1.25.0

require (
	github.com/go-co-op/gocron/v2 v2.21.2
	github.com/jackc/pgx/v5 v5.12.0
	github.com/pgcoord/pgcoord v0.1.0
	github.com/pgcoord/pgcoord/contrib/gocron v0.1.0
)

require (
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/jackc/pgpassfile v1.0.0 // indirect
	github.com/jackc/pgservicefile v0.0.0-20240606120523-5a60cdf6a761 // indirect
	github.com/jackc/puddle/v2 v2.2.3 // indirect
	github.com/jonboulle/clockwork v0.5.0 // indirect
	github.com/robfig/cron/v3 v3.0.1 // indirect
	golang.org/x/sync v0.22.0 // indirect
	golang.org/x/text v0.41.0 // indirect
)
