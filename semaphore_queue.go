package pgcoord

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
)

// The queue
//
// An Acquire that finds no permit lines up on the semaphore's queue key
// with an ordinary blocking lock, so PostgreSQL's lock queue orders the
// waiters of every process (see Fairness in the Semaphore documentation).
// The holder of the queue key, the head, is the only one that may take a
// permit while anyone is queued. Semaphore.lead is the head's loop: it
// tries again on each notification (a release, a change of the limit) and
// every semaphoreRecheck (a permit freed by a backend's death sends none),
// and with limit 1 it waits for the one slot on the server instead
// (Semaphore.await), so the permit passes with no notification.

// lead waits, as the head of the queue (holding q), until a permit is
// granted; the grant releases q. It returns a nil permit and no error if q
// is lost meanwhile. Grants are asked for on q's backend, which holds the
// queue key that the grant releases.
func (s *Semaphore) lead(ctx context.Context, q *core.Lock) (*Permit, error) {
	sub, err := s.c.subscribe(semaphoreChannel, s.payload)
	if err != nil {
		return nil, err
	}
	defer sub.close()
	// With the listener listening already, the subscription's first
	// entry, a resync marker, is queued now: the first look below comes
	// after it. Otherwise it comes once the listener listens, and the
	// head waits on the server (await) only after that: the marker ends
	// an await at once (lookAgain), and should it land as the release
	// grants the slot, after the statement released the queue key, the
	// head would lose its place in the queue. Until then it looks at
	// every re-check.
	live := len(sub.poll()) > 0
	t := time.NewTimer(s.c.semaphoreRecheck)
	defer t.Stop()
	for {
		if q.Err() != nil {
			return nil, nil
		}
		p, adm, err := s.admitHead(ctx, q)
		if core.ErrorIsLoss(err) && q.Err() != nil {
			return nil, nil
		}
		if errors.Is(err, core.ErrRoute) {
			// q's backend is claimed to wait (by this head's own await
			// only, which has ended by now): look again after a while.
			err, adm = nil, admission{}
		}
		if err != nil && !lockTimedOut(err) {
			return nil, err
		}
		if p != nil {
			return p, nil
		}
		if err == nil && adm.limit == 1 && !s.c.noAwait.Load() && live {
			if len(sub.poll()) > 0 {
				continue // something changed meanwhile: look again first
			}
			p, again, err := s.await(ctx, q, sub)
			if core.ErrorIsLoss(err) && q.Err() != nil {
				return nil, nil
			}
			if err != nil {
				return nil, err
			}
			if p != nil {
				return p, nil
			}
			if again {
				continue
			}
		}
		t.Reset(s.c.semaphoreRecheck)
		payloads, err := sub.next(ctx, t.C)
		if err != nil {
			return nil, err
		}
		live = live || len(payloads) > 0
	}
}

// admitHead asks for a permit for the head of the queue, on the backend
// that holds its queue key q, which the grant releases. While that backend
// holds nothing else, the head claims it as a wait (claimWait) and the
// grant may wait there for the semaphore's row; otherwise it does not wait
// for the row (see admitOn), and a transaction that holds the row makes it
// return the lock timeout error: the head looks again at the next
// notification or re-check.
func (s *Semaphore) admitHead(ctx context.Context, q *core.Lock) (*Permit, admission, error) {
	c, b := s.c, q.S
	claimed := c.core.ClaimWait(b, q.Key())
	if claimed {
		defer c.core.UnclaimWait(b)
	}
	return s.admitOn(ctx, b, q, claimed)
}

// errLookAgain ends a head's wait for slot 0 when the semaphore's limit
// changed or notifications may have been lost: the head looks again.
var errLookAgain = errors.New("pgcoord: semaphore: look again")

// lookAgain reports whether payloads hold a change of the limit or a
// resync marker (notifications may have been lost). A release wakes a
// head's wait for slot 0 on the server by itself.
func lookAgain(payloads []string) bool {
	for _, pl := range payloads {
		if pl == "" || strings.HasSuffix(pl, ":limit") {
			return true
		}
	}
	return false
}

// await waits, as the head of the queue of a semaphore of limit 1 (holding
// q), on the server for slot 0 and takes the permit in the same statement
// (semaphore_await): the holder's release grants the slot to the waiting
// statement, as it would grant a lock to a waiter. The wait runs on q's
// backend, in slices like every blocking statement, and counts as one of
// the Client's waits (WithMaxWaits); it runs only while that backend holds
// nothing but q, so that the backend's wait cannot hold anyone else up. A
// change of the limit, or notifications lost with the listener, ends the
// wait, and await reports again: the head looks for a permit at once.
//
// It returns the permit; or nil and again false if the head could not wait
// there (the backend holds other keys, WithMaxWaits waits run already, the
// schema lacks semaphore_await) or slot 0 was free while other slots kept
// the semaphore full (a lowered limit): the head then waits for a
// notification. On error, nothing the statement took stays held.
func (s *Semaphore) await(ctx context.Context, q *core.Lock, sub *subscription) (p *Permit, again bool, err error) {
	c, b := s.c, q.S
	if !c.core.ClaimWait(b, q.Key()) {
		return nil, false, nil
	}
	defer c.core.UnclaimWait(b)

	wctx, cancel := context.WithCancelCause(ctx)
	var (
		watch sync.WaitGroup
		seen  atomic.Bool // the watch took notifications
	)
	stopWatch := func() bool {
		cancel(nil)
		watch.Wait()
		return seen.Load()
	}
	defer stopWatch()
	watch.Go(func() {
		for {
			payloads, err := sub.next(wctx, nil)
			if err != nil {
				return
			}
			seen.Store(true)
			if lookAgain(payloads) {
				cancel(errLookAgain)
				return
			}
		}
	})

	st := core.BlockingStatement{
		Sql:   s.awaitSQL,
		Args:  []any{s.name, s.key.V, s.identity, b.Pid, ""},
		Locks: 2, // slot 0, then the semaphore's row
		Run: func(ctx context.Context, conn *pgx.Conn, sql string, args []any) error {
			var slot *int32
			err := conn.QueryRow(ctx, sql, args...).Scan(&slot, nil, nil)
			if err = b.WrongBackend(err); err != nil || slot == nil {
				return err
			}
			// Recorded before anything else runs on the connection,
			// as admitOn does.
			b.ForgetReleased(q, ErrNotHeld)
			l, err := b.Adopt(s.slotKey(int(*slot)))
			if err != nil {
				s.unadopted(ctx, conn, b)
				return err
			}
			p = &Permit{sem: s, l: l, slot: int(*slot)}
			return nil
		},
		Undo: func(ctx context.Context, conn *pgx.Conn) error {
			// A slice that timed out may have been granted slot 0
			// first.
			_, err := s.cleanupOn(ctx, conn, b)
			return err
		},
	}
	b.RanGrant()
	err = b.Block(wctx, st)
	switch {
	case err == nil:
		// Without a permit, slot 0 was free while others kept the
		// semaphore full: the head waits for a notification, unless the
		// watch took some meanwhile.
		return p, p == nil && stopWatch(), nil
	case core.SqlState(err) == "42883" || core.SqlState(err) == "42501":
		// The schema predates semaphore_await, or the role may not
		// execute it: wait for notifications.
		c.noAwait.Store(true)
		return nil, false, nil
	case b.Err() != nil:
		return nil, false, b.Err()
	}
	// The statement may have taken slot 0 before it failed.
	if gerr := b.Grab(context.WithoutCancel(ctx)); gerr != nil {
		return nil, false, gerr
	}
	s.cleanup(ctx, b, q, true)
	b.Release()
	switch {
	case b.Err() != nil:
		return nil, false, b.Err()
	case ctx.Err() != nil:
		return nil, false, context.Cause(ctx)
	case errors.Is(context.Cause(wctx), errLookAgain) || core.SqlState(err) == "40P01":
		// The limit changed, or the server ended the wait to break a
		// cycle of waits among heads of several semaphores: look again.
		return nil, true, nil
	}
	return nil, false, err
}
