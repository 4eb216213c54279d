package metricmap

import "github.com/pgcoord/pgcoord"

// Chain returns hooks that call each of hooks' functions in turn, in the
// order given, for every event: to pass a metrics value's hooks and hooks
// of your own to one Client. Nil functions are skipped; a kind of event that no hook takes stays nil.
// A function that panics stops the ones after it for that event.
func Chain(hooks ...pgcoord.Hooks) pgcoord.Hooks {
	var h pgcoord.Hooks
	h.OnAcquire = chain(hooks, func(h pgcoord.Hooks) func(pgcoord.AcquireEvent) { return h.OnAcquire })
	h.OnRelease = chain(hooks, func(h pgcoord.Hooks) func(pgcoord.ReleaseEvent) { return h.OnRelease })
	h.OnContention = chain(hooks, func(h pgcoord.Hooks) func(pgcoord.ContentionEvent) { return h.OnContention })
	h.OnLoss = chain(hooks, func(h pgcoord.Hooks) func(pgcoord.LossEvent) { return h.OnLoss })
	h.OnLeadership = chain(hooks, func(h pgcoord.Hooks) func(pgcoord.LeadershipEvent) { return h.OnLeadership })
	h.OnPermit = chain(hooks, func(h pgcoord.Hooks) func(pgcoord.PermitEvent) { return h.OnPermit })
	return h
}

// chain returns a function that calls the non-nil field of each of hooks
// that field picks, or nil if there is none.
func chain[E any](hooks []pgcoord.Hooks, field func(pgcoord.Hooks) func(E)) func(E) {
	var fs []func(E)
	for _, h := range hooks {
		if f := field(h); f != nil {
			fs = append(fs, f)
		}
	}
	switch len(fs) {
	case 0:
		return nil
	case 1:
		return fs[0]
	}
	return func(e E) {
		for _, f := range fs {
			f(e)
		}
	}
}
