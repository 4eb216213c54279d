package pgcoord

import "fmt"

// Keys the server picks
//
// A semaphore's grant is one statement that picks a free slot on the
// server and takes its key: which key it takes, the backend's records learn
// only from the answer. Until then no blocking acquire may claim the
// backend to wait on it (beginGrant), the key is recorded as held once the
// answer names it (adopt), and a key such a statement released is forgotten
// with its handle (forgetReleased, startRelease). A backend that ran a grant
// deletes its holder rows when it closes (ranGrant).

// beginGrant records that a statement which may take a key the backend's
// records cannot show yet (a semaphore's grant) is about to run on b, so
// that no blocking acquire claims b to wait meanwhile; endGrant ends the
// record once the key taken is recorded as held, or released. It returns
// errRoute, recording nothing, if b is claimed to wait already, unless the
// caller claimed it (claimed): the grant then runs elsewhere.
func (b *Session) beginGrant(claimed bool) error {
	b.state.Lock()
	defer b.state.Unlock()
	switch {
	case b.err != nil:
		return b.err
	case b.waiting && !claimed:
		return errRoute
	}
	b.granting++
	return nil
}

// endGrant ends beginGrant's record.
func (b *Session) endGrant() {
	b.state.Lock()
	b.granting--
	b.state.Unlock()
	b.c.backendFreed()
}

// ranGrant records that a grant of a semaphore runs on b, so that b's
// close deletes the rows of the permits b holds then, and those that a
// failed grant may leave. Every permit b adopts comes from such a grant.
func (b *Session) ranGrant() {
	b.state.Lock()
	b.holderRows = true
	b.state.Unlock()
}

// forgetReleased ends l, which the server no longer holds on b, with why,
// and forgets its keys. The caller holds b's connection.
func (b *Session) forgetReleased(l *Lock, why error) {
	b.state.Lock()
	_, mine := b.locks[l]
	delete(b.locks, l)
	if mine {
		for _, k := range l.keys {
			delete(b.keys, k)
		}
	}
	b.state.Unlock()
	if mine {
		l.end(why) // leaves the keys' gates: the next goroutine may line up
	}
}

// adopt records that b holds k, just taken on the server by a statement
// of the caller's, and returns the lock. If b's records still show a
// release of k (its statement is done, its bookkeeping not yet), adopt
// waits for it.
func (b *Session) adopt(k Key) (*Lock, error) {
	for {
		b.state.Lock()
		if b.err != nil {
			b.state.Unlock()
			return nil, b.err
		}
		h := b.keys[k]
		if h == nil {
			b.keys[k] = &keyHold{n: 1}
			// No gate: the row lock of semaphore_acquire, not this
			// process, decides who takes a slot.
			l := &Lock{s: b, keys: []Key{k}}
			l.unreported.Store(true) // a permit, not a Lock of the hooks
			b.locks[l] = struct{}{}
			b.state.Unlock()
			return l, nil
		}
		busy := h.busy
		b.state.Unlock()
		if busy == nil {
			err := fmt.Errorf("%w: the server granted %s to backend %d, which records it as held already", ErrLockLost, k, b.pid)
			b.lose(err)
			return nil, err
		}
		select {
		case <-busy:
		case <-b.done:
		}
	}
}

// startRelease begins the release of l, a handle of k alone on b, by a
// statement of the caller's (a permit's release): k is marked busy, so
// that nothing else about it is decided until forgetKeys ends the
// release. It reports false, changing nothing, if l is no longer b's: the
// backend ended meanwhile and is ending l.
func (b *Session) startRelease(l *Lock, k Key) bool {
	b.state.Lock()
	defer b.state.Unlock()
	_, mine := b.locks[l]
	delete(b.locks, l)
	if mine {
		h := b.keys[k]
		h.n = 0
		h.busy = make(chan struct{})
	}
	return mine
}

// heldInt64Keys returns the values of the single-bigint keys that b's
// records show as held, or in flight, whose value match accepts.
func (b *Session) heldInt64Keys(match func(v int64) bool) []int64 {
	held := []int64{} // an empty array, not NULL, as a statement's argument
	b.state.Lock()
	defer b.state.Unlock()
	for k := range b.keys {
		if k.kind == kindInt64 && match(k.v) {
			held = append(held, k.v)
		}
	}
	return held
}
