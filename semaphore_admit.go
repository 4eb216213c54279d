package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
)

// Admission
//
// A permit is a slot key held on one of the Client's backends; the grant
// (semaphore_acquire, one statement) takes a free slot below the limit and
// writes the holder's row in semaphore_holders. Semaphore.acquire tries to
// be admitted at once and otherwise queues (semaphore_queue.go); the grant
// runs on a backend the routing rule in backends.go allows, and
// Session.adopt (grants.go) records the granted slot on its backend like
// any other key, so it is released, and lost, with that backend.

// admission is what semaphore_acquire answered.
type admission struct {
	limit, holders int
	queued         bool
}

// acquire is Acquire or TryAcquire, reported to OnPermit.
func (s *Semaphore) acquire(ctx context.Context, try bool) (*Permit, error) {
	if ctx == nil {
		op := "acquire"
		if try {
			op = "try acquire"
		}
		return nil, core.Errorf("%s semaphore %s: ctx is nil", op, core.QuoteName(s.name))
	}
	if s.err != nil {
		op := "acquire"
		if try {
			op = "try acquire"
		}
		return nil, s.fail(ctx, op, s.err)
	}
	q := s.c.events
	if q == nil || q.h.OnPermit == nil {
		return s.take(ctx, try)
	}
	start := time.Now()
	// Registered as a call in flight, the acquire keeps Close from
	// closing the hook queue before its event is queued.
	entered := s.c.core.Enter() == nil
	p, err := s.take(ctx, try)
	q.permitAcquired(s, try, start, p, err)
	if entered {
		s.c.core.Wg.Done()
	}
	return p, err
}

func (s *Semaphore) take(ctx context.Context, try bool) (*Permit, error) {
	c := s.c
	op := "acquire"
	if try {
		op = "try acquire"
	}
	if err := c.core.Enter(); err != nil {
		return nil, s.fail(ctx, op, err)
	}
	defer c.core.Wg.Done()
	actx := c.core.AcquireCtx(ctx)
	defer actx.End()
	ctx = actx

	p, adm, err := s.admitRiding(ctx, try)
	switch {
	case err != nil && (try || !lockTimedOut(err)):
		return nil, s.fail(ctx, op, err)
	case p != nil:
		return p, nil
	case try && adm.queued:
		return nil, s.fail(ctx, "try acquire", fmt.Errorf("%w: %d of %d permits held, and other acquires are waiting", ErrNoPermit, adm.holders, adm.limit))
	case try:
		return nil, s.fail(ctx, "try acquire", fmt.Errorf("%w: %d of %d permits held", ErrNoPermit, adm.holders, adm.limit))
	}
	for {
		q, err := c.core.Lock(ctx, s.queueKey(), core.WithoutHooks())
		if err != nil {
			return nil, s.fail(ctx, op, err)
		}
		p, err := s.lead(ctx, q)
		if p != nil {
			return p, nil // the grant released q
		}
		if uerr := s.leave(ctx, q); err == nil && uerr != nil {
			err = fmt.Errorf("leave queue: %w", uerr)
		}
		if err != nil {
			return nil, s.fail(ctx, op, err)
		}
		// The queue key was lost with its backend: line up again.
	}
}

// leave releases the queue key q. It reports no error for a key that was
// lost (the server freed it with its backend) or ended with the Client.
func (s *Semaphore) leave(ctx context.Context, q *core.Lock) error {
	uctx, cancel := core.WithoutCancel(ctx, s.c.core.Cfg.LossDeadline)
	defer cancel()
	err := q.Unlock(uctx)
	// A backend that ended while the release was under way ends q with
	// ErrNotHeld, and Unlock reports how it ended: lost, or closed. A
	// queue place already released (by a grant that then failed, as the
	// Client closed) is left as well.
	if err == nil || core.ErrorIsLoss(q.Err()) || core.ErrorIsLoss(err) || errors.Is(err, ErrNotHeld) {
		return nil
	}
	s.c.core.Cfg.WarnLogger().Warn("pgcoord: semaphore: leave the queue", "semaphore", s.name, "err", err)
	return err
}

// admitRiding is admit, tried again with backoff while the server cannot
// be reached or refuses (a restart, a failover), until ctx ends; a try
// fails fast. Such retries count in Stat's QueuedWaits.
func (s *Semaphore) admitRiding(ctx context.Context, try bool) (*Permit, admission, error) {
	c := s.c
	retry := core.MinRetryInterval
	var last error // the last connection error
	for queued := false; ; {
		p, adm, err := s.admit(ctx)
		switch {
		case err == nil || try || !core.ConnectionTrouble(err):
		case ctx.Err() == nil:
			last = err
			if !queued {
				queued = true
				c.core.QueuedWaits.Add(1)
				defer c.core.QueuedWaits.Add(-1)
			}
			if err = c.core.Pause(ctx, retry); err == nil {
				retry = min(2*retry, core.MaxRetryInterval)
				continue
			}
			fallthrough
		default:
			err = core.EndedWhileRetrying(ctx, err, last)
		}
		return p, adm, err
	}
}

// admit runs semaphore_acquire on a shared backend, for an acquire that
// does not head the queue. A backend found dead takes nothing with it that
// this call holds: it goes on on another.
//
// A backend that a blocking acquire claimed to wait on between the pick and
// the grant takes no grant (see beginGrant): the grant goes to another.
// The shared backend may hold other goroutines' keys, so the grant does not
// wait there for the semaphore's row: when a transaction holds it, the
// grant waits for it on a backend that holds nothing, claimed like a lock
// wait's (see backends.go), or, while no such backend is free, returns the
// lock timeout error.
func (s *Semaphore) admit(ctx context.Context) (*Permit, admission, error) {
	c := s.c
	var err error
	for lost, routed := 0, 0; lost <= c.core.Cfg.SharedBackends+c.core.Cfg.MaxWaits; {
		var b *core.Session
		if b, err = c.core.Route(ctx, core.Request{}); err != nil {
			return nil, admission{}, err
		}
		var p *Permit
		var adm admission
		p, adm, err = s.admitOn(ctx, b, nil, false)
		if lockTimedOut(err) && ctx.Err() == nil {
			w, done, werr := c.core.WaitBackend(ctx)
			switch {
			case werr == nil:
				p, adm, err = s.admitOn(ctx, w, nil, true)
				done()
			case !errors.Is(werr, core.ErrNoWaitBackend):
				err = werr
			}
		}
		switch {
		case errors.Is(err, core.ErrRoute):
			if routed++; routed%core.MaxRoutes == 0 {
				if err := c.core.Pause(ctx, core.MinPollInterval); err != nil {
					return nil, admission{}, err
				}
			}
			continue
		case err == nil || !core.ErrorIsLoss(err) || ctx.Err() != nil:
			return p, adm, err
		}
		lost++
	}
	return nil, admission{}, err
}

// admitOn runs semaphore_acquire on b and records the slot it took as a
// lock of b, before anything else can run on b. q is the queue key that b
// holds for the head of the queue, or nil: a grant to the head releases
// it. If the statement fails, a slot it may have taken before failing is
// released on b, so that nothing stays behind, and q ends if the server no
// longer holds it; if that fails too, b is lost, which frees everything.
// It returns errRoute, sending nothing, if a blocking acquire has claimed
// b to wait on (see beginGrant).
//
// If claimed, the caller has claimed b to wait on (waitBackend or
// claimWait): b holds nothing but q, and the statement may wait for the
// semaphore's row, at most a wait slice. Otherwise b may hold other
// goroutines' keys, and the statement does not wait for the row: when a
// transaction holds it, it fails at once with SQLSTATE 55P03
// (acquireNowaitSQL). A wait there would put b in the row's queue, where
// the deadlock check of that transaction, should it wait for one of b's
// keys, would find a cycle that the application does not have; and the
// statements of b's other locks would wait behind it.
func (s *Semaphore) admitOn(ctx context.Context, b *core.Session, q *core.Lock, claimed bool) (*Permit, admission, error) {
	head := q != nil
	if err := b.BeginGrant(claimed); err != nil {
		return nil, admission{}, err
	}
	defer b.EndGrant()
	if err := b.Grab(ctx); err != nil {
		return nil, admission{}, err
	}
	defer b.Release()
	var (
		slot          *int32
		limit, holder int32
		queued        bool
		adm           admission
	)
	timeout := strconv.FormatInt(s.c.core.Cfg.WaitSlice().Milliseconds(), 10)
	sql := s.acquireNowaitSQL
	if claimed {
		sql = s.acquireSQL
	}
	b.RanGrant()
	err := b.Exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
		err := conn.QueryRow(ctx, sql, s.name, int32(s.limit), s.key.V, head, s.identity, timeout, b.Pid).
			Scan(&slot, &limit, &holder, &queued)
		return b.WrongBackend(err)
	})
	if err != nil {
		if b.Err() == nil && !errors.Is(s.c.notMigratedSemaphore(err), ErrNotMigrated) {
			// A function that does not exist took nothing; any other
			// failure may have come after the slot was taken. A grant
			// that waited for a lock (the semaphore's row, or a table a
			// session holds) beyond its lock_timeout failed before its
			// last step, the slot's lock, and its rows rolled back: the
			// clean-up need not touch the tables, and must not wait for
			// them a second slice while b holds other goroutines' keys.
			s.cleanup(ctx, b, q, !lockTimedOut(err))
		}
		if e := b.Err(); e != nil {
			return nil, adm, e
		}
		return nil, adm, s.c.notMigratedSemaphore(err)
	}
	adm = admission{limit: int(limit), holders: int(holder), queued: queued}
	if slot == nil {
		return nil, adm, nil
	}
	if head {
		b.ForgetReleased(q, ErrNotHeld)
	}
	k := s.slotKey(int(*slot))
	l, err := b.Adopt(k)
	if err != nil {
		_ = b.Exec(ctx, func(ctx context.Context, conn *pgx.Conn) error {
			s.unadopted(ctx, conn, b)
			return nil
		})
		return nil, adm, err
	}
	return &Permit{sem: s, l: l, slot: int(*slot)}, adm, nil
}

// unadopted releases, on conn (b's connection, which the caller holds), a
// slot that a grant just took and that b could not record as held (b
// ended meanwhile: the Client closes, or the connection was lost), with
// its row, so that an Acquire that fails leaves no row behind. With the
// connection gone, the server has freed the slot, and the row is a dead
// holder's, which Holders ignores and later acquires remove.
func (s *Semaphore) unadopted(ctx context.Context, conn *pgx.Conn, b *core.Session) {
	if conn.IsClosed() {
		return
	}
	uctx, cancel := core.WithoutCancel(ctx, s.c.core.Cfg.LossDeadline)
	defer cancel()
	_, _ = s.cleanupOn(uctx, conn, b)
}

// cleanup releases, on b (whose connection the caller holds), every slot
// of the semaphore that b holds on the server but not in its records, and
// with rows their rows too: what a failed semaphore_acquire may have left
// (without rows, the slots only: see cleanupLocksOn). If the server no
// longer holds q, the head's queue key, q ends as lost.
func (s *Semaphore) cleanup(ctx context.Context, b *core.Session, q *core.Lock, rows bool) {
	uctx, cancel := core.WithoutCancel(ctx, s.c.core.Cfg.LossDeadline)
	defer cancel()
	var queueHeld bool
	err := b.Exec(uctx, func(ctx context.Context, conn *pgx.Conn) error {
		var err error
		if rows {
			queueHeld, err = s.cleanupOn(ctx, conn, b)
		} else {
			queueHeld, err = s.cleanupLocksOn(ctx, conn, b)
		}
		return err
	})
	switch {
	case err != nil:
		b.Lose(fmt.Errorf("release after failed semaphore acquire: %w", err))
	case q != nil && !queueHeld:
		b.ForgetReleased(q, fmt.Errorf("%w: a failed grant released the queue key %s", ErrLockLost, q.Key()))
	}
}

// cleanupOn runs cleanup's statement on conn, b's connection, and reports
// whether b holds the semaphore's queue key on the server.
func (s *Semaphore) cleanupOn(ctx context.Context, conn *pgx.Conn, b *core.Session) (queueHeld bool, err error) {
	var n int64
	err = conn.QueryRow(ctx, s.cleanupSQL, s.prefix, s.knownSlots(b), s.name, b.Pid).Scan(&n, &queueHeld)
	if rowsFailed(err, conn) {
		// The rows cannot be had within the connection's lock_timeout
		// (another session holds semaphore_holders, or the rows) or
		// written (a read-only database): the statement, whose unlocks
		// come after its deletion, did nothing, so free the slots
		// without their rows, instead of losing b and every other
		// goroutine's lock on it.
		return s.cleanupLocksOn(ctx, conn, b)
	}
	return queueHeld, err
}

// cleanupLocksOn is cleanupOn without the rows: it releases the slots of
// the semaphore that b holds on the server but not in its records, and
// touches no table. The rows it leaves name a backend that no longer
// holds their slots: Holders ignores them and the next grant removes them.
func (s *Semaphore) cleanupLocksOn(ctx context.Context, conn *pgx.Conn, b *core.Session) (queueHeld bool, err error) {
	var n int64
	err = conn.QueryRow(ctx, s.cleanupLocksSQL, s.prefix, s.knownSlots(b), b.Pid).Scan(&n, &queueHeld)
	return queueHeld, err
}

// knownSlots returns the keys of the semaphore that b records as held.
func (s *Semaphore) knownSlots(b *core.Session) []int64 {
	return b.HeldInt64Keys(func(v int64) bool { return v>>16 == s.prefix })
}
