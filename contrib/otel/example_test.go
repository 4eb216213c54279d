package pgcoordotel_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pgcoord/pgcoord"
	pgcoordotel "github.com/pgcoord/pgcoord/contrib/otel"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

// Record a Client's metrics with OpenTelemetry. The hooks go to the Client
// when it is built; the Client is watched for its connections.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/app")
	if err != nil {
		log.Fatal(err)
	}
	// An exporter's reader in a real program (OTLP, Prometheus, ...).
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	// snippet:start
	m, err := pgcoordotel.New(pgcoordotel.WithMeterProvider(provider)) // default: the global provider
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close()
	invoices := pgcoord.HashKey("invoices")
	client, err := pgcoord.New(pool,
		m.Option(), // or pgcoord.WithHooks(pgcoordotel.Chain(m.Hooks(), myHooks))
		pgcoord.WithKeyNames(map[pgcoord.Key]string{invoices: "invoices"}), // pgcoord.lock.name
	)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close(ctx)
	m.Watch(client) // pgcoord.connection.count and the rest, from client.Stat()
	// snippet:end
}
