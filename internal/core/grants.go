package core

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

// BeginGrant records that a statement which may take a key the backend's
// records cannot show yet (a semaphore's grant) is about to run on b, so
// that no blocking acquire claims b to wait meanwhile; endGrant ends the
// record once the key taken is recorded as held, or released. It returns
// errRoute, recording nothing, if b is claimed to wait already, unless the
// caller claimed it (claimed): the grant then runs elsewhere.
func (b *Session) BeginGrant(claimed bool) error {
	b.State.Lock()
	defer b.State.Unlock()
	switch {
	case b.err != nil:
		return b.err
	case b.Waiting && !claimed:
		return ErrRoute
	}
	b.granting++
	return nil
}

// EndGrant ends beginGrant's record.
func (b *Session) EndGrant() {
	b.State.Lock()
	b.granting--
	b.State.Unlock()
	b.c.backendFreed()
}

// RanGrant records that a grant of a semaphore runs on b, so that b's
// close deletes the rows of the permits b holds then, and those that a
// failed grant may leave. Every permit b adopts comes from such a grant.
func (b *Session) RanGrant() {
	b.State.Lock()
	b.holderRows = true
	b.State.Unlock()
}

// ForgetReleased ends l, which the server no longer holds on b, with why,
// and forgets its keys. The caller holds b's connection.
func (b *Session) ForgetReleased(l *Lock, why error) {
	b.State.Lock()
	_, mine := b.locks[l]
	delete(b.locks, l)
	if mine {
		for _, k := range l.KeyList {
			delete(b.Holds, k)
		}
	}
	b.State.Unlock()
	if mine {
		l.End(why) // leaves the keys' gates: the next goroutine may line up
	}
}

// Adopt records that b holds k, just taken on the server by a statement
// of the caller's, and returns the lock. If b's records still show a
// release of k (its statement is done, its bookkeeping not yet), adopt
// waits for it.
func (b *Session) Adopt(k Key) (*Lock, error) {
	for {
		b.State.Lock()
		if b.err != nil {
			b.State.Unlock()
			return nil, b.err
		}
		h := b.Holds[k]
		if h == nil {
			b.Holds[k] = &keyHold{n: 1}
			// No gate: the row lock of semaphore_acquire, not this
			// process, decides who takes a slot.
			l := b.c.newHandle()
			l.S, l.KeyList = b, []Key{k}
			l.unreported.Store(true) // a permit, not a Lock of the hooks
			b.locks[l] = struct{}{}
			b.State.Unlock()
			return l, nil
		}
		busy := h.Busy
		b.State.Unlock()
		if busy == nil {
			err := fmt.Errorf("%w: the server granted %s to backend %d, which records it as held already", ErrLockLost, k, b.Pid)
			b.Lose(err)
			return nil, err
		}
		select {
		case <-busy:
		case <-b.done:
		}
	}
}

// StartRelease begins the release of l, a handle of k alone on b, by a
// statement of the caller's (a permit's release): k is marked busy, so
// that nothing else about it is decided until forgetKeys ends the
// release. It reports false, changing nothing, if l is no longer b's: the
// backend ended meanwhile and is ending l.
func (b *Session) StartRelease(l *Lock, k Key) bool {
	b.State.Lock()
	defer b.State.Unlock()
	_, mine := b.locks[l]
	delete(b.locks, l)
	if mine {
		h := b.Holds[k]
		h.n = 0
		h.Busy = make(chan struct{})
	}
	return mine
}

// HeldInt64Keys returns the values of the single-bigint keys that b's
// records show as held, or in flight, whose value match accepts.
func (b *Session) HeldInt64Keys(match func(v int64) bool) []int64 {
	held := []int64{} // an empty array, not NULL, as a statement's argument
	b.State.Lock()
	defer b.State.Unlock()
	for k := range b.Holds {
		if k.kind == kindInt64 && match(k.V) {
			held = append(held, k.V)
		}
	}
	return held
}
