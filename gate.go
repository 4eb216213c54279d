package pgcoord

import (
	"context"
	"sync"
	"time"
)

// gates queue the goroutines of one Client that want the same key, so that
// only one of them at a time (or a group of readers) goes to the server:
// a hundred goroutines waiting for one key use no backend while they wait.
//
// A gate admits in arrival order: a goroutine waits while anyone arrived
// before it still waits, so neither readers nor writers starve. Readers
// that arrive together behind nothing incompatible are admitted together.
//
// Handoff: when an exclusive holder releases a key and the first goroutine
// waiting at the gate wants it exclusively on a backend that can take it
// over, the lock is passed on without a round trip: the backend keeps the
// key, the old handle ends and its release is reported, then the new one
// is delivered, and its acquire claims it (see Lock.claim). At most
// maxHandoffs consecutive handoffs, within handoffWindow of the key being
// taken from the server, are allowed; after that the key is released on
// the server, so that waiters in other processes get their turn.
type gates struct {
	maxHandoffs   int
	handoffWindow time.Duration

	mu sync.Mutex
	m  map[Key]*gate
}

type gate struct {
	readers  int
	writer   bool
	queue    []*gateWaiter // in arrival order
	handoffs int           // consecutive handoffs since the key was last admitted plainly
	since    time.Time     // when it was
}

type gateWaiter struct {
	shared   bool
	accept   func(*Lock) bool // can this waiter take over the lock? nil: never
	ready    chan *Lock       // receives nil on admission, or the lock handed over
	admitted bool
}

// enter waits until the gate of k admits a reader (shared) or a writer,
// or until ctx is done. try makes it return false at once instead of
// waiting. queued, if not nil, is called when enter starts to wait. It
// returns a non-nil lock when a holder handed one over: the caller still
// owns the gate until its claim of the lock (Lock.claim) passes the gate
// to the lock, and leaves the gate itself if the claim fails. The caller
// must call leave(k, shared) once admitted without a lock.
func (g *gates) enter(ctx context.Context, k Key, shared, try bool, accept func(*Lock) bool, queued func()) (*Lock, bool, error) {
	g.mu.Lock()
	if g.m == nil {
		g.m = make(map[Key]*gate)
	}
	e := g.m[k]
	if e == nil {
		e = &gate{}
		g.m[k] = e
	}
	if len(e.queue) == 0 && e.admits(shared) {
		e.admit(shared)
		g.mu.Unlock()
		return nil, true, nil
	}
	if try {
		g.gc(k, e)
		g.mu.Unlock()
		return nil, false, nil
	}
	w := &gateWaiter{shared: shared, accept: accept, ready: make(chan *Lock, 1)}
	e.queue = append(e.queue, w)
	g.mu.Unlock()
	if queued != nil {
		queued()
	}

	select {
	case l := <-w.ready:
		return l, true, nil
	case <-ctx.Done():
	}
	g.mu.Lock()
	if w.admitted {
		// Admitted as ctx ended: take it.
		g.mu.Unlock()
		return <-w.ready, true, nil
	}
	for i, x := range e.queue {
		if x == w {
			e.queue = append(e.queue[:i:i], e.queue[i+1:]...)
			break
		}
	}
	e.dispatch() // the ones behind it may go now
	g.gc(k, e)
	g.mu.Unlock()
	return nil, false, context.Cause(ctx)
}

// leave gives back what enter admitted.
func (g *gates) leave(k Key, shared bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	e := g.m[k]
	if shared {
		e.readers--
	} else {
		e.writer = false
	}
	e.dispatch()
	g.gc(k, e)
}

// handoff passes l, an exclusive single-key lock being released, to the
// first waiter at its gate if that is allowed, and reports whether it did.
// l's release is reported to the hooks before the waiter gets the lock, so
// that it comes before the waiter's acquire.
func (g *gates) handoff(l *Lock, transfer func() *Lock) bool {
	if l.shared || len(l.keys) != 1 || g.maxHandoffs == 0 {
		return false
	}
	k := l.keys[0]
	g.mu.Lock()
	e := g.m[k]
	if e == nil || len(e.queue) == 0 || !e.writer {
		g.mu.Unlock()
		return false
	}
	w := e.queue[0]
	if w.shared || w.accept == nil || !w.accept(l) ||
		e.handoffs >= g.maxHandoffs || time.Since(e.since) >= g.handoffWindow {
		g.mu.Unlock()
		return false
	}
	next := transfer()
	if next == nil {
		g.mu.Unlock()
		return false
	}
	e.handoffs++
	e.queue = e.queue[1:]
	// Admitted: a waiter whose ctx ends now waits for the send below.
	w.admitted = true
	g.mu.Unlock()
	l.released(true, nil)
	w.ready <- next
	return true
}

func (e *gate) admits(shared bool) bool {
	if shared {
		return !e.writer
	}
	return !e.writer && e.readers == 0
}

func (e *gate) admit(shared bool) {
	if shared {
		e.readers++
	} else {
		e.writer = true
	}
	e.handoffs = 0
	e.since = time.Now()
}

// dispatch admits waiters from the front of the queue while they fit.
func (e *gate) dispatch() {
	for len(e.queue) > 0 && e.admits(e.queue[0].shared) {
		w := e.queue[0]
		e.queue = e.queue[1:]
		e.admit(w.shared)
		w.admitted = true
		w.ready <- nil
		if !w.shared {
			return
		}
	}
}

// gc frees the gate of k when nobody holds or waits for it.
func (g *gates) gc(k Key, e *gate) {
	if e.readers == 0 && !e.writer && len(e.queue) == 0 {
		delete(g.m, k)
	}
}
