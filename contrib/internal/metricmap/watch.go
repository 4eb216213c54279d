package metricmap

import (
	"sync"
	"weak"

	"github.com/pgcoord/pgcoord"
)

// Watched is the set of Clients whose Stat a metrics value reports at
// each collection. The zero value is an empty set. Its methods are safe
// for concurrent use.
type Watched struct {
	mu      sync.Mutex
	clients []*pgcoord.Client
	dropped int64 // dropped hook events of Clients no longer watched
	// folded holds, for each Client unwatched once, its dropped hook
	// events already added to dropped, so that watching it again counts
	// only what it drops after that. Weak: a Client dropped by its user
	// is not kept alive for this.
	folded map[weak.Pointer[pgcoord.Client]]int64
}

// Watch adds client to the set. Watching a Client twice counts it once.
func (w *Watched) Watch(client *pgcoord.Client) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range w.clients {
		if c == client {
			return
		}
	}
	w.clients = append(w.clients, client)
}

// Unwatch removes client from the set. Its dropped hook events stay
// counted in the sum that Stat returns.
func (w *Watched) Unwatch(client *pgcoord.Client) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, c := range w.clients {
		if c == client {
			d := client.Stat().DroppedHookEvents
			if w.folded == nil {
				w.folded = make(map[weak.Pointer[pgcoord.Client]]int64)
			}
			wp := weak.Make(client)
			w.dropped += d - w.folded[wp]
			w.folded[wp] = d
			w.clients = append(w.clients[:i:i], w.clients[i+1:]...)
			return
		}
	}
}

// Stat returns the sum of the watched Clients' Stat; its
// DroppedHookEvents also counts those of the Clients unwatched, each
// event once.
func (w *Watched) Stat() pgcoord.Stat {
	w.mu.Lock()
	defer w.mu.Unlock()
	sum := pgcoord.Stat{DroppedHookEvents: w.dropped}
	for _, c := range w.clients {
		st := c.Stat()
		st.DroppedHookEvents -= w.folded[weak.Make(c)]
		sum.Backends += st.Backends
		sum.Sessions += st.Sessions
		sum.Connecting += st.Connecting
		sum.Waits += st.Waits
		sum.QueuedWaits += st.QueuedWaits
		sum.Locks += st.Locks
		sum.DroppedHookEvents += st.DroppedHookEvents
	}
	return sum
}
