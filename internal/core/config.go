package core

// A Client's settings, as its options left them

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
)

// Config holds what the options of New, Open, Migrate and CheckFence set.
type Config struct {
	Heartbeat      time.Duration
	LossDeadline   time.Duration
	Logger         *slog.Logger
	AppName        string
	Schema         string
	MaxWaits       int
	SharedBackends int
	MaxHandoffs    int
	HandoffWindow  time.Duration
	SessionPooler  bool
	KeyNames       map[Key]string
	Hooks          LockHooks
}

// WaitSlice is how long one slice of a blocking acquire waits on the
// server before it answers (with a lock timeout) and waits again: short
// enough that two slices and their round trips fit in the loss deadline
// with a heartbeat's margin, so a wait never lets the lease run out on a
// healthy connection.
func (c *Config) WaitSlice() time.Duration { return (c.LossDeadline - c.Heartbeat) / 2 }

// QuotedSchema returns the schema as a quoted SQL identifier.
func (c *Config) QuotedSchema() string { return pgx.Identifier{c.Schema}.Sanitize() }

// Table returns the quoted, schema-qualified name of one of pgcoord's tables.
func (c *Config) Table(name string) string {
	return c.QuotedSchema() + "." + pgx.Identifier{name}.Sanitize()
}

// KeyName returns k's name from WithKeyNames, or "".
func (c *Config) KeyName(k Key) string { return c.KeyNames[k] }

// debugging reports whether the configured logger takes Debug records.
func (c *Config) debugging() bool {
	return c.Logger != nil && c.Logger.Enabled(context.Background(), slog.LevelDebug)
}

// WarnLogger returns the logger for warnings: WithLogger's, else
// slog.Default(), so that a lost lock is never silent.
func (c *Config) WarnLogger() *slog.Logger {
	if c.Logger != nil {
		return c.Logger
	}
	return slog.Default()
}

// InfoLogger returns WithLogger's logger, or one that discards.
func (c *Config) InfoLogger() *slog.Logger {
	if c.Logger != nil {
		return c.Logger
	}
	return discard
}

var discard = slog.New(slog.DiscardHandler)
