package pgcoordgocron

import (
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/pgcoord/pgcoord"
)

// Defaults of the options.
const (
	// DefaultMinHold is how long a Locker holds a job's lock at least,
	// counted from the call of Lock, unless WithMinHold says otherwise.
	DefaultMinHold = time.Second

	// DefaultRetryInterval is how long an Elector waits before it
	// campaigns again after a campaign failed, unless WithRetryInterval
	// says otherwise.
	DefaultRetryInterval = time.Second

	// MinTickInterval is the shortest interval WithTicks accepts: shorter
	// ticks cannot be told apart from the round trip of a lock.
	MinTickInterval = time.Millisecond

	// maxPrefix bounds WithKeyPrefix.
	maxPrefix = 1024
)

// LockerOption configures a Locker (see NewLocker): WithKeyPrefix,
// WithMinHold, WithTicks. NewLocker returns an error for an invalid one,
// or for two that exclude each other.
type LockerOption interface {
	applyLocker(*lockerConfig) error
}

// ElectorOption configures an Elector (see NewElector):
// WithElectionOptions, WithRetryInterval. NewElector returns an error for
// an invalid one.
type ElectorOption interface {
	applyElector(*electorConfig) error
}

type lockerConfig struct {
	prefix     string
	minHold    time.Duration
	minHoldSet bool          // WithMinHold was given
	interval   time.Duration // WithTicks; 0 in the minimum-hold mode
	now        func() time.Time
}

// check reports options that contradict each other.
func (c *lockerConfig) check() error {
	if c.interval > 0 && c.minHoldSet {
		return errors.New("WithMinHold and WithTicks exclude each other: with WithTicks every tick's lock is held one and a half intervals; drop WithMinHold")
	}
	return nil
}

type electorConfig struct {
	election []pgcoord.ElectionOption
	retry    time.Duration
}

type lockerOption func(*lockerConfig) error

func (f lockerOption) applyLocker(c *lockerConfig) error { return f(c) }

type electorOption func(*electorConfig) error

func (f electorOption) applyElector(c *electorConfig) error { return f(c) }

// WithKeyPrefix puts the Locker's keys in a namespace of their own: the
// lock of job name is pgcoord.HashKey("pgcoord.gocron.job", prefix, name)
// (default prefix ""), and with WithTicks the lock of its tick n is
// pgcoord.HashKey("pgcoord.gocron.tick", prefix, name, n in decimal). Use it when two applications share a database and
// may have jobs of the same name that must not exclude each other. The
// prefix must be valid UTF-8 of at most 1024 bytes.
func WithKeyPrefix(prefix string) LockerOption {
	return lockerOption(func(c *lockerConfig) error {
		if len(prefix) > maxPrefix || !utf8.ValidString(prefix) {
			return fmt.Errorf("WithKeyPrefix: the prefix must be valid UTF-8 of at most %d bytes, got %d bytes", maxPrefix, len(prefix))
		}
		c.prefix = prefix
		return nil
	})
}

// WithMinHold sets how long a Locker holds a job's lock at least, counted
// from the moment Lock was called (default DefaultMinHold, 1s). It is how
// the Locker handles the clock splay between schedulers: every scheduler
// fires the same tick at about the same time, the first takes the lock and
// runs the job, and the others, whose clocks or timers are a little
// behind, find the lock still held and skip the tick, even when the run
// took less time than the splay. A run that lasts longer than d holds the
// lock until it ends, as with d = 0.
//
// The Unlock that the scheduler calls when the run ends returns at once;
// the release happens in the background when the rest of d has passed
// (Locker.Close cuts it short). Choose d larger than the splay you expect
// between schedulers (timer latency, clock differences, and the round trip
// of the lock) and smaller than the job's interval: a tick that comes
// while the lock is still held is skipped, on every scheduler, including
// the one that ran the previous tick, so d at or above the interval runs
// the job at most every other tick. For jobs that run more often than once
// a second, set d below their interval. d must be 0 or more; 0 releases as
// soon as the run ends, which excludes overlapping runs only.
//
// A minimum hold limits a job to one run per hold, but cannot make every
// tick run exactly once: a scheduler whose timer fires more than d after
// the winner's runs the same tick again. WithTicks can; it excludes
// WithMinHold.
func WithMinHold(d time.Duration) LockerOption {
	return lockerOption(func(c *lockerConfig) error {
		if d < 0 {
			return fmt.Errorf("WithMinHold: the minimum hold must be 0 or more, got %v", d)
		}
		c.minHold, c.minHoldSet = d, true
		return nil
	})
}

// WithTicks makes the Locker lock ticks rather than jobs: each tick of a
// job runs exactly once across the schedulers, as long as the schedules
// are aligned to interval, the schedulers are at most interval/2 late or
// early by their own clocks, their clocks differ by less than interval/2,
// and no lock is lost during a run (see below). The Locker numbers time
// in ticks of interval since the Unix epoch, and Lock takes the lock of
// the job's tick nearest to the moment it is called (rounded to the
// nearest, not down): tick n, the moment n×interval after
// 1970-01-01T00:00:00Z, is locked by every call of Lock from interval/2
// before it to interval/2 after it (that end excluded), by the caller's
// clock. The first scheduler to call Lock for tick n gets its lock, and
// holds it one and a half intervals from its call of Lock: one interval
// covers the whole window on its own clock, and the other half interval
// is the allowance for clocks that differ, so the hold outlasts the
// window on every clock less than interval/2 off. A scheduler that calls
// Lock for the same tick later in its window is refused
// (pgcoord.ErrLocked). The next tick has another key, so it is never
// skipped because of its predecessor. Lock refuses, with ErrTickPassed, a
// lock that it could take only after the end of its tick's window, when
// the tick's first holder may have released it.
//
// The requirements, which the Locker cannot check:
//
//   - Every job the Locker locks runs at multiples of interval since the
//     epoch, the same times in every scheduler: a gocron.CronJob whose
//     times all fall on the grid (WithTicks(time.Minute) suits every cron
//     job without a seconds field), or a gocron.DurationJob of a duration
//     d that is a multiple of interval, started in every scheduler at a
//     multiple of d since the epoch with gocron.WithStartAt
//     (time.Now().Truncate(d).Add(d) is one when d divides 24 hours:
//     Truncate counts from the zero time, a whole number of days before
//     the epoch). gocron.WithIntervalFromCompletion breaks the alignment.
//     Two times of a job that round to the same tick run once; jobs on
//     different grids take a Locker each (gocron.WithDistributedJobLocker).
//   - Lateness tolerance is interval/2, by the scheduler's own clock: a
//     scheduler whose Lock comes more than interval/2 after the tick (a
//     late timer, a paused process), or interval/2 or more before it,
//     computes another tick. It is refused if another scheduler has run
//     that tick already; if not, it runs it early (or late), and the
//     scheduler that is on time for it is refused. Either way every tick
//     number runs at most once. A tick all schedulers are late for by
//     more than interval/2, or whose window passes while the lock is
//     being taken, does not run.
//   - The schedulers' clocks differ by less than interval/2 (NTP keeps
//     them within milliseconds): the calls of one tick's window on two
//     clocks e apart spread over up to interval + e of real time, which
//     the hold covers only while e is under the allowance of interval/2.
//     Clocks further apart can run a tick twice.
//
// Runs of a job do not overlap while their locks are held: Lock also
// takes the job's own lock (Locker.Key), held while the run goes on, and
// skips the tick, giving its lock back at once, when a run of an earlier
// tick goes on anywhere (then another scheduler may still run the tick
// within its window, once that run has ended). A run that outlasts the
// interval makes the following ticks be skipped, as in gocron's singleton
// mode. A lock lost during a run (its backend terminated, its connection
// broken, a server restart or failover) is freed by the server at once,
// while the run goes on: another scheduler may then run the job, this
// tick too if still within its window, overlapping that run. See the
// Locker type for how a job learns of that (JobLock.Done) or fences its
// writes.
//
// A scheduler holds the locks of at most three recent ticks per job (one
// and a half intervals each, from calls an interval apart: two when its
// timers are on time, three when one was late), and the job's lock during
// a run, all on the Client's shared connections. Locker.Close, and the
// death of the process, release the tick locks at once: a scheduler that
// calls Lock for such a tick afterwards, still within its window, runs it
// again. Close the Locker at least one interval after the last tick its
// scheduler ran, or accept that rare repeat.
//
// interval must be at least MinTickInterval (1ms).
func WithTicks(interval time.Duration) LockerOption {
	return lockerOption(func(c *lockerConfig) error {
		if interval < MinTickInterval {
			return fmt.Errorf("WithTicks: the interval must be at least %v, got %v", MinTickInterval, interval)
		}
		c.interval = interval
		return nil
	})
}

// withClock makes the Locker read the time from now instead of time.Now:
// for tests only (see export_test.go). The background releases still
// wait on real timers, for the durations the clock gives.
func withClock(now func() time.Time) LockerOption {
	return lockerOption(func(c *lockerConfig) error {
		if now == nil {
			return errors.New("withClock: nil clock")
		}
		c.now = now
		return nil
	})
}

// WithElectionOptions passes options to the pgcoord election the Elector
// campaigns in, such as pgcoord.WithIdentity, which names this process in
// Election.Leader and Observe.
func WithElectionOptions(opts ...pgcoord.ElectionOption) ElectorOption {
	return electorOption(func(c *electorConfig) error {
		for _, o := range opts {
			if o == nil {
				return errors.New("WithElectionOptions: nil pgcoord.ElectionOption")
			}
		}
		c.election = append(c.election, opts...)
		return nil
	})
}

// WithRetryInterval sets how long an Elector waits before it campaigns
// again after a campaign failed, for example because the server could not
// be reached for a while (default DefaultRetryInterval, 1s). It must be
// positive.
func WithRetryInterval(d time.Duration) ElectorOption {
	return electorOption(func(c *electorConfig) error {
		if d <= 0 {
			return fmt.Errorf("WithRetryInterval: the interval must be positive, got %v", d)
		}
		c.retry = d
		return nil
	})
}
