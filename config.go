package pgcoord

// A Client's settings, as its options left them

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
)

// config holds what the options of New, Open, Migrate and CheckFence set.
type config struct {
	heartbeat      time.Duration
	lossDeadline   time.Duration
	logger         *slog.Logger
	appName        string
	schema         string
	maxWaits       int
	sharedBackends int
	maxHandoffs    int
	handoffWindow  time.Duration
	sessionPooler  bool
	keyNames       map[Key]string
	hooks          lockHooks
}

// waitSlice is how long one slice of a blocking acquire waits on the
// server before it answers (with a lock timeout) and waits again: short
// enough that two slices and their round trips fit in the loss deadline
// with a heartbeat's margin, so a wait never lets the lease run out on a
// healthy connection.
func (c *config) waitSlice() time.Duration { return (c.lossDeadline - c.heartbeat) / 2 }

// quotedSchema returns the schema as a quoted SQL identifier.
func (c *config) quotedSchema() string { return pgx.Identifier{c.schema}.Sanitize() }

// table returns the quoted, schema-qualified name of one of pgcoord's tables.
func (c *config) table(name string) string {
	return c.quotedSchema() + "." + pgx.Identifier{name}.Sanitize()
}

// keyName returns k's name from WithKeyNames, or "".
func (c *config) keyName(k Key) string { return c.keyNames[k] }

// debugging reports whether the configured logger takes Debug records.
func (c *config) debugging() bool {
	return c.logger != nil && c.logger.Enabled(context.Background(), slog.LevelDebug)
}

// warnLogger returns the logger for warnings: WithLogger's, else
// slog.Default(), so that a lost lock is never silent.
func (c *config) warnLogger() *slog.Logger {
	if c.logger != nil {
		return c.logger
	}
	return slog.Default()
}

// infoLogger returns WithLogger's logger, or one that discards.
func (c *config) infoLogger() *slog.Logger {
	if c.logger != nil {
		return c.logger
	}
	return discard
}

var discard = slog.New(slog.DiscardHandler)
