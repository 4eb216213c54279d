package pgcoordgocron

import "errors"

// Sentinel errors. Test for them with errors.Is: they come wrapped with the
// election's or the job's name and, where there is one, the cause.
var (
	// ErrNotLeader is returned by Elector.IsLeader and Elector.Term when
	// this process does not lead the election: it has not won yet, another
	// process leads, the leadership has ended or is ending (its context is
	// cancelled), the server has not answered on the leader's connections
	// within the loss deadline (then pgcoord.ErrLockLost is wrapped too),
	// or the Elector was closed (then pgcoord.ErrClosed is wrapped too).
	ErrNotLeader = errors.New("pgcoordgocron: not the leader")

	// ErrTickPassed is returned by Locker.Lock with WithTicks when the
	// lock of the tick was taken only after the end of the tick's window
	// (the interval/2 after the tick), when the scheduler that ran the
	// tick may have released it already. The lock is released at once and
	// the tick is skipped, as when the lock is held.
	ErrTickPassed = errors.New("pgcoordgocron: the tick's window ended before its lock was taken")
)
