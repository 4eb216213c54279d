package pgcoordtest_test

import (
	"testing"
	"time"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/pgcoordtest"
)

// A test may end while its Proxy is blackholed and its Client still
// holds a lock: the Client's close then cannot confirm the release, which
// is what the test asked for, and neither fails the test nor holds up its
// cleanup. The Client's close gives up after its loss deadline and makes
// pgx send a cancel request on a new connection through the proxy while
// the proxy stops; that connection must not keep the proxy's cleanup
// waiting for the server, which closes it only after
// authentication_timeout (60 s). A few rounds, since the cancel request
// races with the proxy's stop.
func TestProxyBlackholedAtTheEndOfATest(t *testing.T) {
	for round := range 4 {
		test := &exampleT{name: "TestEndsBlackholed"}
		start := time.Now()
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer test.cleanup()
			dsn := pgcoordtest.DB(test)
			p := pgcoordtest.NewProxy(test, dsn)
			c := pgcoordtest.Client(test, p.ConnString(), short...)
			if _, err := c.Lock(ctxT(test), pgcoord.HashKey("blackholed at the end")); err != nil {
				test.Fatal(err)
			}
			p.Blackhole()
		}()
		select {
		case <-done:
		case <-time.After(45 * time.Second):
			t.Fatalf("round %d: the test and its cleanup still run after 45 s", round)
		}
		elapsed := time.Since(start)
		if test.Failed() {
			t.Fatalf("round %d: a test that ended with its Proxy blackholed failed (see its output above)", round)
		}
		if elapsed > 15*time.Second {
			t.Fatalf("round %d: the test and its cleanup took %v; want about the loss deadline (1 s)", round, elapsed)
		}
	}
}
