package pgcoordgocron

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/pgcoord/pgcoord"
)

// keyNamespace is the first part of every job key: the lock of job name is
// pgcoord.HashKey(keyNamespace, prefix, name). tickNamespace is the first
// part of every tick key (WithTicks). They must never change, or
// schedulers of two versions would stop excluding each other.
const (
	keyNamespace  = "pgcoord.gocron.job"
	tickNamespace = "pgcoord.gocron.tick"
)

// Locker is a gocron.Locker on pgcoord advisory locks: pass it to
// gocron.WithDistributedLocker (or WithDistributedJobLocker), and each
// run of a job takes a lock first. Lock tries, it does not wait: when the
// lock is held, the scheduler skips the run. It works in one of two modes:
//
//   - With WithTicks (recommended when the schedules are aligned to a
//     grid): one lock per tick of each job, held at least one and a half
//     intervals, and the job's lock during its run. Each tick runs
//     exactly once across the schedulers, and runs do not overlap, while
//     the locks are held; see WithTicks for the requirements.
//   - By default: one lock per job name, held while the job runs and at
//     least a minimum time from the call of Lock (WithMinHold, default one
//     second). A tick whose job is running, or was run by another
//     scheduler within the minimum hold, is skipped. The job runs at most
//     once per minimum hold, and runs do not overlap while the locks are
//     held, but a scheduler later than the minimum hold runs a tick again.
//
// The locks are session-level locks on the Client's shared backends: if
// the process dies, the server frees its locks at once. If a lock's
// connection is lost during a run (its backend terminated, the connection
// broken, a server restart or failover), the server frees the lock at
// once, but the run goes on: gocron has no way to stop it. Another
// scheduler may then take the job (and, with WithTicks, the same tick,
// within its window) and run it while the first run goes on: the
// exclusion holds only while the locks are held. The Client notices the
// loss within a heartbeat interval (at most its loss deadline); a job that
// must know reads JobLock.Done and JobLock.Err (hand the JobLock to the
// run through a gocron.Locker that wraps this one). A job whose writes
// must never come from an overlapping run fences them: at its start it
// takes a fence, with a pgcoord lock of a key of its own taken with
// pgcoord.WithFence (and released at once), and checks Lock.Fence with
// pgcoord.CheckFence and that key in the transaction of each write; a
// later run's fence makes the earlier run's writes fail.
//
// A Locker's methods are safe for concurrent use.
type Locker struct {
	c        *pgcoord.Client
	prefix   string
	minHold  time.Duration
	interval time.Duration // 0 unless WithTicks
	now      func() time.Time

	mu     sync.Mutex
	closed bool
	held   int           // locks being taken, or handed out and not yet released
	idle   chan struct{} // made by a Close that waits; closed when held drops to 0
	stop   chan struct{} // closed by Close: pending holds end now
}

var _ gocron.Locker = (*Locker)(nil)

// NewLocker returns a Locker that takes its locks through c. It does not
// touch the network. The Client must outlive the Locker.
//
// NewLocker returns an error, and no Locker, for a nil Client, a nil or
// invalid option, or two options that exclude each other (WithMinHold and
// WithTicks), saying what was wrong with each.
func NewLocker(c *pgcoord.Client, opts ...LockerOption) (*Locker, error) {
	cfg := lockerConfig{minHold: DefaultMinHold, now: time.Now}
	var errs []error
	if c == nil {
		errs = append(errs, errors.New("the pgcoord.Client is nil"))
	}
	for _, o := range opts {
		if o == nil {
			errs = append(errs, errors.New("nil LockerOption"))
			continue
		}
		errs = append(errs, o.applyLocker(&cfg))
	}
	errs = append(errs, cfg.check())
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("pgcoordgocron: NewLocker: %w", err)
	}
	lk := &Locker{c: c, stop: make(chan struct{})}
	lk.prefix, lk.minHold, lk.interval, lk.now = cfg.prefix, cfg.minHold, cfg.interval, cfg.now
	if lk.interval > 0 {
		lk.minHold = 0
	}
	return lk, nil
}

// Key returns the pgcoord key of the job called name in the default
// mode: pgcoord.HashKey("pgcoord.gocron.job", prefix, name), with the
// prefix of WithKeyPrefix ("" by default). It is how the job's lock shows
// in pg_locks and Client.Locks. With WithTicks, the locks are TickKey's.
func (lk *Locker) Key(name string) pgcoord.Key { return pgcoord.HashKey(keyNamespace, lk.prefix, name) }

// TickKey returns the pgcoord key of tick n of the job called name, as
// WithTicks locks it: pgcoord.HashKey("pgcoord.gocron.tick", prefix, name,
// strconv.FormatInt(n, 10)), with the prefix of WithKeyPrefix. Tick n is
// the moment n×Interval() after the Unix epoch.
func (lk *Locker) TickKey(name string, n int64) pgcoord.Key {
	return pgcoord.HashKey(tickNamespace, lk.prefix, name, strconv.FormatInt(n, 10))
}

// MinHold returns the Locker's minimum hold (see WithMinHold); 0 with
// WithTicks.
func (lk *Locker) MinHold() time.Duration { return lk.minHold }

// Interval returns the interval of WithTicks, or 0 when the Locker locks
// jobs rather than ticks.
func (lk *Locker) Interval() time.Duration { return lk.interval }

// tickOf returns the number of the tick of interval nearest to t, counted
// from the Unix epoch: the n with t in [n×interval − interval/2,
// n×interval + interval/2).
func tickOf(t time.Time, interval time.Duration) int64 {
	d := int64(interval)
	x := t.UnixNano() + d/2
	n := x / d
	if x%d < 0 {
		n-- // floor for times before the epoch
	}
	return n
}

// tickHold returns how long Lock holds a tick's lock, from its call: the
// interval, which covers the calls of one tick's window on one clock, and
// the allowance for clocks that differ, interval/2.
func tickHold(interval time.Duration) time.Duration { return interval + interval/2 }

// windowEnd returns the end of the window of tick n: the first moment
// whose nearest tick is n+1.
func windowEnd(n int64, interval time.Duration) time.Time {
	return time.Unix(0, n*int64(interval)+int64(interval)-int64(interval)/2)
}

// Lock takes the lock of the job called key (gocron passes the job's
// name), or with WithTicks of the job's tick nearest to now, without
// waiting, and returns it as a *JobLock; gocron runs the job only when
// Lock returns no error, and calls Unlock when the run ends. ctx bounds
// the round trip. Lock returns an error wrapping pgcoord.ErrLocked when
// the lock is held, by another scheduler or by this one (a run not yet
// ended, a minimum hold not yet over, a tick already run); ErrTickPassed
// (WithTicks) when the lock came only after the end of the tick's window;
// pgcoord.ErrClosed after the Locker's or the Client's Close; and the
// Client's errors for TryLock (connection errors, ctx's error).
func (lk *Locker) Lock(ctx context.Context, key string) (gocron.Lock, error) {
	// The hold counts from before the try: the release then comes at
	// least the hold after any moment at which this run could have
	// started, and with WithTicks after the end of the tick's window.
	start := lk.now()
	lk.mu.Lock()
	if lk.closed {
		lk.mu.Unlock()
		return nil, fmt.Errorf("pgcoordgocron: lock job %q: %w", key, pgcoord.ErrClosed)
	}
	lk.held++
	lk.mu.Unlock()
	j := &JobLock{lk: lk, name: key, until: start.Add(lk.minHold)}
	if lk.interval == 0 {
		l, err := lk.c.TryLock(ctx, lk.Key(key))
		if err != nil {
			lk.released()
			return nil, fmt.Errorf("pgcoordgocron: lock %s: %w", j.what(), err)
		}
		j.l = l
		return j, nil
	}
	j.tick, j.ticked = tickOf(start, lk.interval), true
	j.until = start.Add(tickHold(lk.interval))
	l, err := lk.c.TryLock(ctx, lk.TickKey(key, j.tick))
	if err != nil {
		lk.released()
		return nil, fmt.Errorf("pgcoordgocron: lock %s: %w", j.what(), err)
	}
	// Every holder of this tick's key holds it past the end of the tick's
	// window on any clock that differs from its own by less than the
	// allowance. A lock taken before that end was taken while no other
	// scheduler had run the tick; one taken after it may come after the
	// first holder's release, so it is given back.
	if end := windowEnd(j.tick, lk.interval); !lk.now().Before(end) {
		defer lk.released()
		return nil, giveBack(ctx, l, fmt.Errorf("pgcoordgocron: lock %s: %w (window ended %v)",
			j.what(), ErrTickPassed, end.UTC().Format(time.RFC3339Nano)))
	}
	// The job's own lock, held for the run only, keeps the runs of
	// consecutive ticks from overlapping. When a run of an earlier tick
	// goes on, the tick's lock is given back at once: no one has run the
	// tick, so another scheduler may still run it within its window.
	run, err := lk.c.TryLock(ctx, lk.Key(key))
	if err != nil {
		defer lk.released()
		return nil, giveBack(ctx, l, fmt.Errorf("pgcoordgocron: lock %s: the run of an earlier tick goes on: %w", j.what(), err))
	}
	j.l, j.run = l, run
	return j, nil
}

// giveBack releases l, a lock that Lock took but does not hand out, and
// returns err, joined with the release's error if there is one.
func giveBack(ctx context.Context, l *pgcoord.Lock, err error) error {
	if uerr := l.Unlock(context.WithoutCancel(ctx)); uerr != nil {
		// The lock was lost, or its connection closed: the server no
		// longer holds it either way.
		return errors.Join(err, uerr)
	}
	return err
}

// Close makes later calls of Lock fail with pgcoord.ErrClosed, ends the
// holds still running (minimum holds, or with WithTicks the holds of the
// recent ticks: their locks are released now, see WithTicks for what
// that allows), and waits until every lock the Locker handed out has
// been released, which includes the locks of runs still going: shut the
// scheduler down first (gocron's Shutdown waits for running jobs). ctx
// bounds the wait; Close then returns ctx's error, and leaves nothing
// running behind: the locks of runs still going stay held until their
// Unlock (which then releases them at once) or the Client's Close, and
// the holds it ended are released in the background within the Client's
// loss deadline. Calling Close again waits again.
func (lk *Locker) Close(ctx context.Context) error {
	lk.mu.Lock()
	if !lk.closed {
		lk.closed = true
		close(lk.stop)
	}
	if lk.held == 0 {
		lk.mu.Unlock()
		return nil
	}
	if lk.idle == nil {
		lk.idle = make(chan struct{})
	}
	idle := lk.idle
	lk.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("pgcoordgocron: close locker: %w", context.Cause(ctx))
	}
}

// released counts off a lock that Lock failed to take, gave back, or
// whose release (or loss) is complete, and wakes the Closes that wait
// once none is left.
func (lk *Locker) released() {
	lk.mu.Lock()
	defer lk.mu.Unlock()
	lk.held--
	if lk.held == 0 && lk.idle != nil {
		close(lk.idle)
		lk.idle = nil
	}
}

// JobLock is a held lock of a job, or of a job's tick, as Locker.Lock
// returns it.
type JobLock struct {
	lk     *Locker
	name   string
	l      *pgcoord.Lock
	until  time.Time     // the end of the hold
	run    *pgcoord.Lock // WithTicks: the job's lock, released when the run ends
	tick   int64
	ticked bool // WithTicks: tick is set

	once     sync.Once
	doneOnce sync.Once
	done     <-chan struct{} // see Done
}

var _ gocron.Lock = (*JobLock)(nil)

// Key returns the pgcoord key of the lock: Locker.Key of the job, or with
// WithTicks Locker.TickKey of the job's tick.
func (j *JobLock) Key() pgcoord.Key { return j.l.Key() }

// Tick returns the number of the tick the lock is for, the moment
// n×interval after the Unix epoch, and true, with WithTicks; 0 and false
// otherwise.
func (j *JobLock) Tick() (n int64, ok bool) { return j.tick, j.ticked }

// Done returns a channel that is closed when the run's exclusion ends:
// when one of the pgcoord locks the JobLock rests on ends (the job's lock,
// and with WithTicks the tick's lock too). During the run, that means a
// lock was lost (its backend terminated, its connection broken, a server
// restart or failover, the Client's Close): the server has freed it, and
// another scheduler may run the job (with WithTicks, this tick too) while
// this run goes on; Err then says why. After Unlock it is closed once the
// released lock ends. The Client notices a loss within a heartbeat
// interval, at most its loss deadline, after it happened. A job learns of
// it through a gocron.Locker that wraps the Locker and hands the JobLock
// to the run.
func (j *JobLock) Done() <-chan struct{} {
	j.doneOnce.Do(func() {
		if j.run == nil {
			j.done = j.l.Done()
			return
		}
		// Either lock may end first; the merge ends with it.
		done := make(chan struct{})
		go func() {
			defer close(done)
			select {
			case <-j.l.Done():
			case <-j.run.Done():
			}
		}()
		j.done = done
	})
	return j.done
}

// Err returns nil while every lock the JobLock rests on is held (see
// Done). Otherwise it returns the error of the first that ended, wrapped
// with the job's name: one wrapping pgcoord.ErrLockLost (and the cause)
// if it was lost, pgcoord.ErrClosed if the Client was closed, or
// pgcoord.ErrNotHeld once it was released by Unlock (or, for a tick's
// lock, at the end of its hold or the Locker's Close).
func (j *JobLock) Err() error {
	for _, l := range []*pgcoord.Lock{j.run, j.l} {
		if l == nil {
			continue
		}
		if err := l.Err(); err != nil {
			return fmt.Errorf("pgcoordgocron: %s: %w", j.what(), err)
		}
	}
	return nil
}

// what names the lock in errors.
func (j *JobLock) what() string {
	if j.ticked {
		return fmt.Sprintf("job %q tick %d", j.name, j.tick)
	}
	return fmt.Sprintf("job %q", j.name)
}

// Unlock releases the lock: at once if its hold (the minimum hold, or
// with WithTicks one and a half intervals from the call of Lock) is over,
// or if the lock has ended already (lost, see Done: its error is returned); else it
// returns nil at once, without waiting, and the lock is released in the
// background when the hold is over (or when the Locker is closed, or the
// lock is lost meanwhile). The release works even if ctx is
// cancelled, as gocron's job context is on shutdown, and is bounded by
// the Client's loss deadline. Unlock returns an error wrapping
// pgcoord.ErrNotHeld when called again, and the error of an immediate
// release (see pgcoord.Lock.Unlock: a lost lock, or a failed release whose
// connection was then closed, so that the server frees the key).
func (j *JobLock) Unlock(ctx context.Context) error {
	first := false
	j.once.Do(func() { first = true })
	if !first {
		return fmt.Errorf("pgcoordgocron: unlock %s: %w: already unlocked", j.what(), pgcoord.ErrNotHeld)
	}
	var runErr error
	if j.run != nil {
		runErr = j.run.Unlock(ctx)
	}
	wait := j.until.Sub(j.lk.now())
	if wait <= 0 || j.l.Err() != nil {
		defer j.lk.released()
		if err := errors.Join(runErr, j.l.Unlock(ctx)); err != nil {
			return fmt.Errorf("pgcoordgocron: unlock %s: %w", j.what(), err)
		}
		return nil
	}
	go func() {
		defer j.lk.released()
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-t.C:
		case <-j.lk.stop:
		case <-j.l.Done():
		}
		// An error here means the lock was lost, or its connection was
		// closed: either way the server no longer holds it.
		_ = j.l.Unlock(context.WithoutCancel(ctx))
	}()
	if runErr != nil {
		return fmt.Errorf("pgcoordgocron: unlock %s: %w", j.what(), runErr)
	}
	return nil
}
