package pgcoordotel

import (
	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/contrib/internal/metricmap"
)

// Chain returns hooks that call each of hooks' functions in turn, in the
// order given, for every event: to pass a Metrics' hooks and hooks of
// your own to one Client, as pgcoord.WithHooks(Chain(m.Hooks(), mine)).
// Nil functions are skipped; a kind of event that no hook takes stays nil.
// A function that panics stops the ones after it for that event.
func Chain(hooks ...pgcoord.Hooks) pgcoord.Hooks { return metricmap.Chain(hooks...) }
