package pgcoord

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// cancelHandler ends a statement whose context is done by sending the
// server a cancel request, as pgconn.CancelRequestContextWatcherHandler
// does, with a precise guard instead of its fixed 100 ms sleep.
//
// The danger a guard prevents is a cancel request that reaches the backend
// after the cancelled statement has finished and the next one has begun.
// PostgreSQL signals the backend before it closes the cancel connection,
// and CancelRequest returns only when it has read that close; a backend
// handles a pending signal before it can read another statement, and a
// cancel that arrives while it waits for a statement is ignored. So once
// CancelRequest has returned, the cancel can no longer hit a later
// statement, and HandleUnwatchAfterCancel waits exactly that long. A
// connection through a proxy that forwards cancel requests asynchronously
// loses that guarantee; pgcoord treats a cancellation it did not ask for
// as a broken session.
//
// If the cancel request cannot be delivered, the socket's deadline,
// deadlineDelay after the cancel, ends the statement and the connection.
type cancelHandler struct {
	conn          *pgconn.PgConn
	deadlineDelay time.Duration

	sent chan struct{} // closed when the cancel request has been answered
	stop context.CancelFunc
}

// HandleCancel sends the cancel request at once, in the background.
func (h *cancelHandler) HandleCancel(context.Context) {
	deadline := time.Now().Add(h.deadlineDelay)
	_ = h.conn.Conn().SetDeadline(deadline)
	ctx, stop := context.WithDeadline(context.Background(), deadline)
	h.sent, h.stop = make(chan struct{}), stop
	go func(sent chan struct{}) {
		defer close(sent)
		_ = h.conn.CancelRequest(ctx)
	}(h.sent)
}

// HandleUnwatchAfterCancel returns once the server has acted on the cancel
// request, so that it cannot cancel the connection's next statement.
func (h *cancelHandler) HandleUnwatchAfterCancel() {
	<-h.sent
	h.stop()
	_ = h.conn.Conn().SetDeadline(time.Time{})
}
