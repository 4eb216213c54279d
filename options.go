package pgcoord

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/pgcoord/pgcoord/internal/core"
)

// Options of a Client
//
// Option configures New and Open; LoggerOption and SchemaOption also apply
// elsewhere (Migrate takes the schema). Every option checks its value and
// New reports a bad one.

// Defaults of the liveness settings. See [WithHeartbeat] and
// [WithLossDeadline], and the package documentation for how they bound the
// time during which two holders could both believe they hold a key.
const (
	DefaultHeartbeat    = 1 * time.Second
	DefaultLossDeadline = 5 * time.Second
	DefaultSchema       = "pgcoord"
)

// Option configures a [Client] ([New], [Open]). Invalid values are
// reported as errors by New or Open, never silently replaced. The options
// of [Migrate] ([MigrateOption]) and [CheckFence] ([FenceOption]) are
// types of their own, so an option that does not apply there does not
// compile; [WithSchema] and [WithLogger] serve more than one.
type Option interface {
	apply(*core.Config) error
}

// MigrateOption configures [Migrate]: [WithSchema] and [WithLogger].
type MigrateOption interface {
	applyMigrate(*core.Config) error
}

// FenceOption configures [CheckFence]: [WithSchema].
type FenceOption interface {
	applyFence(*core.Config) error
}

type optionFunc struct {
	name string
	f    func(*core.Config) error
}

func (o optionFunc) apply(c *core.Config) error {
	if err := o.f(c); err != nil {
		return core.Errorf("option %s: %w", o.name, err)
	}
	return nil
}

// SchemaOption is the option of [WithSchema]: an [Option], a
// [MigrateOption] and a [FenceOption].
type SchemaOption struct{ o optionFunc }

func (o SchemaOption) apply(c *core.Config) error        { return o.o.apply(c) }
func (o SchemaOption) applyMigrate(c *core.Config) error { return o.o.apply(c) }
func (o SchemaOption) applyFence(c *core.Config) error   { return o.o.apply(c) }

// LoggerOption is the option of [WithLogger]: an [Option] and a
// [MigrateOption].
type LoggerOption struct{ o optionFunc }

func (o LoggerOption) apply(c *core.Config) error        { return o.o.apply(c) }
func (o LoggerOption) applyMigrate(c *core.Config) error { return o.o.apply(c) }

func newConfig(opts []Option) (*core.Config, error) {
	fs := make([]func(*core.Config) error, len(opts))
	for i, o := range opts {
		if o != nil {
			fs[i] = o.apply
		}
	}
	return buildConfig("Option", fs)
}

func newMigrateConfig(opts []MigrateOption) (*core.Config, error) {
	fs := make([]func(*core.Config) error, len(opts))
	for i, o := range opts {
		if o != nil {
			fs[i] = o.applyMigrate
		}
	}
	return buildConfig("MigrateOption", fs)
}

func newFenceConfig(opts []FenceOption) (*core.Config, error) {
	fs := make([]func(*core.Config) error, len(opts))
	for i, o := range opts {
		if o != nil {
			fs[i] = o.applyFence
		}
	}
	return buildConfig("FenceOption", fs)
}

// buildConfig applies the options fs (nil for a nil option of the given
// kind) to the defaults.
func buildConfig(kind string, fs []func(*core.Config) error) (*core.Config, error) {
	c := &core.Config{
		Heartbeat:    DefaultHeartbeat,
		LossDeadline: DefaultLossDeadline,
		AppName:      "pgcoord",
		Schema:       DefaultSchema,

		MaxWaits:       DefaultMaxWaits,
		SharedBackends: DefaultSharedBackends,
		MaxHandoffs:    DefaultMaxHandoffs,
		HandoffWindow:  DefaultHandoffWindow,
	}
	var errs []error
	for _, f := range fs {
		if f == nil {
			errs = append(errs, errors.New("pgcoord: nil "+kind))
			continue
		}
		errs = append(errs, f(c))
	}
	if c.Heartbeat*2 > c.LossDeadline {
		errs = append(errs, core.Errorf("heartbeat %v must be at most half the loss deadline %v, so one missed beat is not a loss", c.Heartbeat, c.LossDeadline))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return c, nil
}

// WithHeartbeat sets how often a session proves its connection is alive
// (default [DefaultHeartbeat]). It must be positive and at most half the loss
// deadline.
func WithHeartbeat(d time.Duration) Option {
	return optionFunc{"WithHeartbeat", func(c *core.Config) error {
		if d <= 0 {
			return core.Errorf("interval must be positive, got %v", d)
		}
		c.Heartbeat = d
		return nil
	}}
}

// WithLossDeadline sets the client-side loss deadline L (default
// [DefaultLossDeadline]): a session whose last successful heartbeat is older
// than L declares its locks lost. The server is told to drop a silent
// client's locks after about 2L (see the package documentation), so the old
// holder gives up before anyone else can acquire. It must be at least 1s.
func WithLossDeadline(d time.Duration) Option {
	return optionFunc{"WithLossDeadline", func(c *core.Config) error {
		if d < time.Second {
			return core.Errorf("deadline must be at least 1s, got %v", d)
		}
		c.LossDeadline = d
		return nil
	}}
}

// WithLogger sets the logger of the Client (or of Migrate). Lost locks
// are logged at Warn (the keys, the backend and the cause), hooks that
// panic at Error, migrations applied at Info, and every acquire,
// contention and release at Debug. Without WithLogger, Warn and Error
// records go to slog.Default() (a lost lock is never silent) and the
// others are discarded. Debug records cost nothing unless the logger is
// enabled for Debug. It must not be nil.
func WithLogger(l *slog.Logger) LoggerOption {
	return LoggerOption{optionFunc{"WithLogger", func(c *core.Config) error {
		if l == nil {
			return errors.New("logger is nil")
		}
		c.Logger = l
		return nil
	}}}
}

// WithApplicationName sets application_name on pgcoord's connections
// (default "pgcoord"), which shows in pg_stat_activity next to their locks.
// It must be non-empty and shorter than 64 bytes.
func WithApplicationName(name string) Option {
	return optionFunc{"WithApplicationName", func(c *core.Config) error {
		if name == "" || len(name) >= 64 {
			return core.Errorf("name must be 1 to 63 bytes, got %d bytes", len(name))
		}
		c.AppName = name
		return nil
	}}
}

// WithSchema sets the schema that holds pgcoord's tables (default
// [DefaultSchema]). Pass the same schema to [New] or [Open], to [Migrate]
// and to [CheckFence], or use a Client's [Client.Migrate] and
// [Client.CheckFence], which take the Client's. The name is always quoted,
// so it is used exactly as given.
//
// A schema is a namespace for the Client's elections and semaphores: their
// advisory keys include the schema's name (see [Election.Key] and
// [Semaphore.Key]), so applications that share a database, each with its
// own schema, can use the same names without meeting. The keys of the
// application's own locks ([HashKey], [Int64Key], [PairKey]) are the same
// in every schema, as advisory locks are per database; their fences are
// counted in the schema's fences table.
func WithSchema(name string) SchemaOption {
	return SchemaOption{optionFunc{"WithSchema", func(c *core.Config) error {
		if name == "" || len(name) >= 64 {
			return core.Errorf("schema name must be 1 to 63 bytes, got %d bytes", len(name))
		}
		for _, r := range name {
			if r == 0 {
				return errors.New("schema name must not contain NUL")
			}
		}
		c.Schema = name
		return nil
	}}}
}

// WithMaxWaits sets how many blocking acquires of the Client's own locks
// (Lock, RLock, LockAll, Do, campaigns, semaphore queues) may wait on the
// server at once (default [DefaultMaxWaits]). A wait runs on a dedicated
// connection that holds no other lock, opened when needed; the Client has
// at most [WithSharedBackends] + n connections for its locks. A blocking
// acquire that finds no connection it may wait on tries its keys again
// (at once when a wait ends or a connection frees up, else at growing
// intervals of at most 100ms) until it can wait or gets them; it uses no
// connection meanwhile, and never holds up other acquires. It must be 1 to
// 1000.
func WithMaxWaits(n int) Option {
	return optionFunc{"WithMaxWaits", func(c *core.Config) error {
		if n < 1 || n > 1000 {
			return core.Errorf("must be 1 to 1000, got %d", n)
		}
		c.MaxWaits = n
		return nil
	}}
}

// WithSharedBackends sets how many dedicated connections serve the
// Client's tries and hold its locks (default [DefaultSharedBackends]).
// More lets more acquires run at the same moment; every held lock lives on
// one of them or on a connection that waited for it (see [WithMaxWaits]).
// It must be 1 to 64.
func WithSharedBackends(n int) Option {
	return optionFunc{"WithSharedBackends", func(c *core.Config) error {
		if n < 1 || n > 64 {
			return core.Errorf("must be 1 to 64, got %d", n)
		}
		c.SharedBackends = n
		return nil
	}}
}

// Defaults of [WithHandoff].
const (
	DefaultMaxHandoffs   = 16
	DefaultHandoffWindow = 10 * time.Millisecond
)

// WithHandoff bounds in-process handoff. When a goroutine releases an
// exclusive single-key lock of a Client (or of a Session) while another
// goroutine of the same Client waits for that key (Lock or Do, on the
// Client or the same Session), the lock passes to it directly: no round
// trip, and the releasing handle has ended before the new one is returned.
// Other processes that wait for the key meanwhile wait longer, so a run of
// handoffs stops after max consecutive handoffs or once window has passed
// since the key was last taken from the server, whichever comes first; the
// key is then released on the server, where the next holder is decided.
// WithHandoff(0, 0) turns handoff off. Defaults: [DefaultMaxHandoffs],
// [DefaultHandoffWindow]. max must be 0 to 1000 and window 0 to 1s, and
// both zero or both positive.
func WithHandoff(max int, window time.Duration) Option {
	return optionFunc{"WithHandoff", func(c *core.Config) error {
		if max < 0 || max > 1000 || window < 0 || window > time.Second || (max == 0) != (window == 0) {
			return core.Errorf("want max 0 to 1000 and window 0 to 1s, both zero or both positive; got %d and %v", max, window)
		}
		c.MaxHandoffs, c.HandoffWindow = max, window
		return nil
	}}
}

// WithSessionPooler lets the Client's lock connections go through a
// connection pooler (PgBouncer, pgcat, RDS Proxy, ...) that the caller
// knows runs in session mode, where each client connection keeps one server
// backend. Without it, a lock connection that reaches the server through a
// pooler (its backend pid differs from the one announced at connect) is
// refused with [ErrTransactionPooling], because transaction pooling cannot
// be told apart from session pooling with certainty. With it, pgcoord still
// refuses a pooler that it catches sharing backends: a second connection
// that lands on the session's backend, or a statement that lands on
// another. TCP-level proxies (HAProxy, cloud-sql-proxy) are not poolers
// and need no option.
func WithSessionPooler() Option {
	return optionFunc{"WithSessionPooler", func(c *core.Config) error {
		c.SessionPooler = true
		return nil
	}}
}

// checkText checks a name or identity that pgcoord stores as text: 1 to
// limit bytes of UTF-8 without NUL.
func checkText(what, v string, limit int) error {
	switch {
	case v == "":
		return fmt.Errorf("%s is empty; give it 1 to %d bytes", what, limit)
	case len(v) > limit:
		return fmt.Errorf("%s is %d bytes long; at most %d are allowed (use a shorter name, or a hash of a long one)", what, len(v), limit)
	case !utf8.ValidString(v):
		return fmt.Errorf("%s %s is not valid UTF-8, which PostgreSQL text requires", what, core.QuoteName(v))
	}
	if i := strings.IndexByte(v, 0); i >= 0 {
		return fmt.Errorf("%s %s contains a NUL byte at %d, which PostgreSQL text cannot store", what, core.QuoteName(v), i)
	}
	return nil
}
