package core

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

	Mu sync.Mutex
	M  map[Key]*gate
}

type gate struct {
	readers  int
	Writer   bool
	Queue    []*gateWaiter // in arrival order
	handoffs int           // consecutive handoffs since the key was last admitted plainly
	since    time.Time     // when it was
}

type gateWaiter struct {
	shared   bool
	accept   func(*Lock) bool // can this waiter take over the lock? nil: never
	ready    chan *Lock       // receives nil on admission, or the lock handed over
	admitted bool
}

// Enter waits until the gate of k admits a reader (shared) or a writer,
// or until ctx is done. try makes it return false at once instead of
// waiting. queued, if not nil, is called when enter starts to wait. It
// returns a non-nil lock when a holder handed one over: the caller still
// owns the gate until its claim of the lock (Lock.claim) passes the gate
// to the lock, and leaves the gate itself if the claim fails. The caller
// must call leave(k, shared) once admitted without a lock.
func (g *gates) Enter(ctx context.Context, k Key, shared, try bool, accept func(*Lock) bool, queued func()) (*Lock, bool, error) {
	g.Mu.Lock()
	if g.M == nil {
		g.M = make(map[Key]*gate)
	}
	e := g.M[k]
	if e == nil {
		e = &gate{}
		g.M[k] = e
	}
	if len(e.Queue) == 0 && e.admits(shared) {
		e.admit(shared)
		g.Mu.Unlock()
		return nil, true, nil
	}
	if try {
		g.gc(k, e)
		g.Mu.Unlock()
		return nil, false, nil
	}
	w := &gateWaiter{shared: shared, accept: accept, ready: make(chan *Lock, 1)}
	e.Queue = append(e.Queue, w)
	g.Mu.Unlock()
	if queued != nil {
		queued()
	}

	select {
	case l := <-w.ready:
		return l, true, nil
	case <-ctx.Done():
	}
	g.Mu.Lock()
	if w.admitted {
		// Admitted as ctx ended: take it.
		g.Mu.Unlock()
		return <-w.ready, true, nil
	}
	for i, x := range e.Queue {
		if x == w {
			e.Queue = append(e.Queue[:i:i], e.Queue[i+1:]...)
			break
		}
	}
	e.dispatch() // the ones behind it may go now
	g.gc(k, e)
	g.Mu.Unlock()
	return nil, false, context.Cause(ctx)
}

// leave gives back what enter admitted.
func (g *gates) leave(k Key, shared bool) {
	g.Mu.Lock()
	defer g.Mu.Unlock()
	e := g.M[k]
	if shared {
		e.readers--
	} else {
		e.Writer = false
	}
	e.dispatch()
	g.gc(k, e)
}

// handoff passes l, an exclusive single-key lock being released, to the
// first waiter at its gate if that is allowed, and reports whether it did.
// l's release is reported to the hooks before the waiter gets the lock, so
// that it comes before the waiter's acquire.
func (g *gates) handoff(l *Lock, transfer func() *Lock) bool {
	if l.Shared || len(l.KeyList) != 1 || g.maxHandoffs == 0 {
		return false
	}
	k := l.KeyList[0]
	g.Mu.Lock()
	e := g.M[k]
	if e == nil || len(e.Queue) == 0 || !e.Writer {
		g.Mu.Unlock()
		return false
	}
	w := e.Queue[0]
	if w.shared || w.accept == nil || !w.accept(l) ||
		e.handoffs >= g.maxHandoffs || time.Since(e.since) >= g.handoffWindow {
		g.Mu.Unlock()
		return false
	}
	next := transfer()
	if next == nil {
		g.Mu.Unlock()
		return false
	}
	e.handoffs++
	e.Queue = e.Queue[1:]
	// Admitted: a waiter whose ctx ends now waits for the send below.
	w.admitted = true
	g.Mu.Unlock()
	l.released(true, nil)
	w.ready <- next
	return true
}

func (e *gate) admits(shared bool) bool {
	if shared {
		return !e.Writer
	}
	return !e.Writer && e.readers == 0
}

func (e *gate) admit(shared bool) {
	if shared {
		e.readers++
	} else {
		e.Writer = true
	}
	e.handoffs = 0
	e.since = time.Now()
}

// dispatch admits waiters from the front of the queue while they fit.
func (e *gate) dispatch() {
	for len(e.Queue) > 0 && e.admits(e.Queue[0].shared) {
		w := e.Queue[0]
		e.Queue = e.Queue[1:]
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
	if e.readers == 0 && !e.Writer && len(e.Queue) == 0 {
		delete(g.M, k)
	}
}
