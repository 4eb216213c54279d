package pgcoordprom_test

import (
	"context"
	"log"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	pgcoordprom "github.com/pgcoord/pgcoord/contrib/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Publish a Client's metrics on /metrics. The Collector's hooks go to the
// Client when it is built; the Client is watched for its connections.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/app")
	if err != nil {
		log.Fatal(err)
	}
	// snippet:start
	m, err := pgcoordprom.New()
	if err != nil {
		log.Fatal(err)
	}
	invoices := pgcoord.HashKey("invoices")
	client, err := pgcoord.New(pool,
		m.Option(), // or pgcoord.WithHooks(pgcoordprom.Chain(m.Hooks(), myHooks))
		pgcoord.WithKeyNames(map[pgcoord.Key]string{invoices: "invoices"}), // the name label
	)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close(ctx)
	m.Watch(client) // connections and waits, from client.Stat()

	reg := prometheus.NewRegistry()
	reg.MustRegister(m)
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	// snippet:end
}
