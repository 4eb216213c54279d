package pgcoord

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
)

// Defaults of the liveness settings. See [WithHeartbeat] and
// [WithLossDeadline], and the package documentation for how they bound the
// time during which two holders could both believe they hold a key.
const (
	DefaultHeartbeat    = 1 * time.Second
	DefaultLossDeadline = 5 * time.Second
	DefaultSchema       = "pgcoord"
)

// Option configures a [Client] (New, Open), [Migrate] or [CheckFence]. Invalid values and
// options that do not apply are reported as errors by the function they are
// passed to, never silently replaced.
type Option interface {
	apply(*config) error
}

type optionFunc struct {
	name  string
	where scope
	f     func(*config) error
}

type scope uint8

const (
	scopeClient scope = 1 << iota
	scopeMigrate
	scopeFence
)

func (o optionFunc) apply(c *config) error {
	if o.where&c.scope == 0 {
		return fmt.Errorf("pgcoord: option %s does not apply to %s", o.name, c.scope)
	}
	if err := o.f(c); err != nil {
		return fmt.Errorf("pgcoord: option %s: %w", o.name, err)
	}
	return nil
}

func (s scope) String() string {
	switch s {
	case scopeMigrate:
		return "Migrate"
	case scopeFence:
		return "CheckFence"
	}
	return "New/Open"
}

type config struct {
	scope        scope
	heartbeat    time.Duration
	lossDeadline time.Duration
	logger       *slog.Logger
	appName      string
	schema       string
}

func newConfig(s scope, opts []Option) (*config, error) {
	c := &config{
		scope:        s,
		heartbeat:    DefaultHeartbeat,
		lossDeadline: DefaultLossDeadline,
		logger:       slog.New(slog.DiscardHandler),
		appName:      "pgcoord",
		schema:       DefaultSchema,
	}
	var errs []error
	for _, o := range opts {
		if o == nil {
			errs = append(errs, errors.New("pgcoord: nil Option"))
			continue
		}
		errs = append(errs, o.apply(c))
	}
	if c.heartbeat*2 > c.lossDeadline {
		errs = append(errs, fmt.Errorf("pgcoord: heartbeat %v must be at most half the loss deadline %v, so one missed beat is not a loss", c.heartbeat, c.lossDeadline))
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
	return optionFunc{"WithHeartbeat", scopeClient, func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("interval must be positive, got %v", d)
		}
		c.heartbeat = d
		return nil
	}}
}

// WithLossDeadline sets the client-side loss deadline L (default
// [DefaultLossDeadline]): a session whose last successful heartbeat is older
// than L declares its locks lost. The server is told to drop a silent
// client's locks after about 2L (see the package documentation), so the old
// holder gives up before anyone else can acquire. It must be at least 1s.
func WithLossDeadline(d time.Duration) Option {
	return optionFunc{"WithLossDeadline", scopeClient, func(c *config) error {
		if d < time.Second {
			return fmt.Errorf("deadline must be at least 1s, got %v", d)
		}
		c.lossDeadline = d
		return nil
	}}
}

// WithLogger sets the logger for session loss, heartbeat failures and
// cleanup problems (default: discard). It must not be nil.
func WithLogger(l *slog.Logger) Option {
	return optionFunc{"WithLogger", scopeClient | scopeMigrate, func(c *config) error {
		if l == nil {
			return errors.New("logger is nil")
		}
		c.logger = l
		return nil
	}}
}

// WithApplicationName sets application_name on pgcoord's connections
// (default "pgcoord"), which shows in pg_stat_activity next to their locks.
// It must be non-empty and shorter than 64 bytes.
func WithApplicationName(name string) Option {
	return optionFunc{"WithApplicationName", scopeClient, func(c *config) error {
		if name == "" || len(name) >= 64 {
			return fmt.Errorf("name must be 1 to 63 bytes, got %d bytes", len(name))
		}
		c.appName = name
		return nil
	}}
}

// WithSchema sets the schema that holds pgcoord's tables (default
// [DefaultSchema]). Pass the same schema to [Migrate], to [New] or [Open],
// and to [CheckFence]. The name is always quoted, so it is used exactly as given.
func WithSchema(name string) Option {
	return optionFunc{"WithSchema", scopeClient | scopeMigrate | scopeFence, func(c *config) error {
		if name == "" || len(name) >= 64 {
			return fmt.Errorf("schema name must be 1 to 63 bytes, got %d bytes", len(name))
		}
		for _, r := range name {
			if r == 0 {
				return errors.New("schema name must not contain NUL")
			}
		}
		c.schema = name
		return nil
	}}
}

// quotedSchema returns the schema as a quoted SQL identifier.
func (c *config) quotedSchema() string { return pgx.Identifier{c.schema}.Sanitize() }
