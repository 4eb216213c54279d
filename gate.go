package pgcoord

import (
	"context"
	"sync"
)

// gates queue the goroutines of one Client that want the same key, so that
// only one of them at a time (or a group of readers) goes to the server:
// a hundred goroutines waiting for one key use one backend, not a hundred.
// A gate is writer-preferring like sync.RWMutex: once a writer waits, new
// readers wait behind it.
type gates struct {
	mu sync.Mutex
	m  map[Key]*gate
}

type gate struct {
	refs    int // goroutines holding or waiting; the entry is freed at 0
	readers int
	writer  bool
	writers int           // writers waiting
	changed chan struct{} // closed and replaced whenever the gate opens up
}

// enter waits until the gate of k admits a reader (shared) or a writer,
// or until ctx is done. try makes it return false at once instead of
// waiting. The caller must call leave(k, shared) once admitted.
func (g *gates) enter(ctx context.Context, k Key, shared, try bool) (bool, error) {
	g.mu.Lock()
	if g.m == nil {
		g.m = make(map[Key]*gate)
	}
	e := g.m[k]
	if e == nil {
		e = &gate{changed: make(chan struct{})}
		g.m[k] = e
	}
	e.refs++
	waiting := false
	for {
		if !e.writer && (shared && e.writers == 0 || !shared && e.readers == 0) {
			if waiting && !shared {
				e.writers--
			}
			if shared {
				e.readers++
			} else {
				e.writer = true
			}
			g.mu.Unlock()
			return true, nil
		}
		if try {
			g.release(k, e)
			g.mu.Unlock()
			return false, nil
		}
		if !waiting && !shared {
			e.writers++
		}
		waiting = true
		ch := e.changed
		g.mu.Unlock()
		select {
		case <-ch:
			g.mu.Lock()
		case <-ctx.Done():
			g.mu.Lock()
			if !shared {
				e.writers--
				e.broadcast() // readers held back by this writer may go
			}
			g.release(k, e)
			g.mu.Unlock()
			return false, context.Cause(ctx)
		}
	}
}

// leave gives back what enter admitted.
func (g *gates) leave(k Key, shared bool) {
	g.mu.Lock()
	e := g.m[k]
	if shared {
		e.readers--
	} else {
		e.writer = false
	}
	e.broadcast()
	g.release(k, e)
	g.mu.Unlock()
}

func (e *gate) broadcast() {
	close(e.changed)
	e.changed = make(chan struct{})
}

func (g *gates) release(k Key, e *gate) {
	e.refs--
	if e.refs == 0 {
		delete(g.m, k)
	}
}
