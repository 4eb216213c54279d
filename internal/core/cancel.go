package core

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// CancelHandler ends a statement whose context is done by sending the
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
// The same rule loses a cancel that comes too early: a statement whose
// context ends as it is sent (a slice of a wait interrupted the moment it
// resumed, see Session.block) may reach the backend after the cancel
// request did, while the backend still waited for it, so the cancel is
// ignored and the statement runs on, for a lock wait until the end of its
// slice. So the handler sends the cancel request again, at growing
// intervals (cancelRepeat, up to maxCancelRepeat), for as long as the
// statement runs: a repeated request, like the first, lands on this
// statement or on an idle backend, never on a later statement, since
// HandleUnwatchAfterCancel stops the repeats and waits for the request in
// flight to be answered.
//
// If the cancel request cannot be delivered, the socket's deadline,
// deadlineDelay after the cancel, ends the statement and the connection.
// CancelRequest also returns at that deadline when the server has not
// answered, the request perhaps still on its way: then the deadline is
// left in place, so that the connection fails its next statement before
// sending it, rather than run one that the request may yet cancel.
type CancelHandler struct {
	Conn          *pgconn.PgConn
	DeadlineDelay time.Duration

	sent    chan struct{} // closed when the last cancel request has been answered, or cut by the deadline
	unwatch chan struct{} // closed by HandleUnwatchAfterCancel: no more repeats
	// deadline, the socket's deadline, ends the cancel requests: one
	// still unanswered then may yet reach the backend.
	deadline context.Context
	stop     context.CancelFunc
}

// Intervals at which a cancel request is sent again while the statement
// runs on (see cancelHandler).
const (
	cancelRepeat    = 10 * time.Millisecond
	maxCancelRepeat = 200 * time.Millisecond
)

// HandleCancel sends the cancel request at once, in the background, and
// again while the statement runs.
func (h *CancelHandler) HandleCancel(context.Context) {
	deadline := time.Now().Add(h.DeadlineDelay)
	_ = h.Conn.Conn().SetDeadline(deadline)
	ctx, stop := context.WithDeadline(context.Background(), deadline)
	h.sent, h.unwatch, h.deadline, h.stop = make(chan struct{}), make(chan struct{}), ctx, stop
	go func(sent, unwatch chan struct{}) {
		defer close(sent)
		for wait := cancelRepeat; ; wait = min(2*wait, maxCancelRepeat) {
			_ = h.Conn.CancelRequest(ctx)
			if ctx.Err() != nil {
				return // cut by the deadline: see HandleUnwatchAfterCancel
			}
			t := time.NewTimer(wait)
			select {
			case <-t.C:
			case <-unwatch:
				t.Stop()
				return
			case <-ctx.Done():
				t.Stop()
				return
			}
		}
	}(h.sent, h.unwatch)
}

// HandleUnwatchAfterCancel returns once the server has acted on the cancel
// requests sent, so that none can cancel the connection's next statement.
//
// Once the deadline has passed, a request that it cut before the server
// answered it may still reach the backend, and cancel whatever statement
// runs then. The connection's deadline, which passed with it, is then left
// as it is: the connection's next statement fails before it is sent, and
// the connection is closed, instead of running a statement that a late
// cancel may end. (A statement still running at the deadline fails with
// it anyway; this stops one that ended just before it from being followed
// by another.)
func (h *CancelHandler) HandleUnwatchAfterCancel() {
	close(h.unwatch)
	<-h.sent
	passed := h.deadline.Err() != nil
	h.stop()
	if passed {
		return
	}
	_ = h.Conn.Conn().SetDeadline(time.Time{})
}
