package pgcoord

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
)

// The Client's listener
//
// Elections (Observe, and candidates waiting for a leader that steps
// down) and semaphores (waiters for a permit) are woken by NOTIFY. A Client
// that needs notifications opens one more dedicated connection, the
// listener, the first time it does, and keeps it until Close: it LISTENs on
// pgcoord's channels and hands each notification to the subscriptions that
// asked for it. One connection serves every election and semaphore of the
// Client. When the listener's connection fails, the Client opens another
// (with a backoff, while the Client is open) and tells every subscription
// to re-read the state it follows, since notifications sent meanwhile are
// lost. Notifications are a wake-up, never the only path: every waiter also
// re-checks on its own bounded schedule.

// Channels pgcoord notifies on. A payload starts with the decimal lock key
// of the election or semaphore it is about, then a colon.
const (
	leaderChannel    = "pgcoord_leader"
	semaphoreChannel = "pgcoord_semaphore"
)

// listenerBackoff bounds the pause between attempts to reopen the
// listener's connection.
const (
	listenerMinBackoff = 50 * time.Millisecond
	listenerMaxBackoff = 2 * time.Second
)

// notifier owns the listener connection of a Client.
type notifier struct {
	mu      sync.Mutex
	subs    map[*subscription]struct{}
	started bool
}

// A subscription receives the payloads of one channel that start with a
// prefix. Payloads queue in order until taken by next; a resync marker
// ("") says notifications may have been lost and the state must be read
// again.
type subscription struct {
	c       *Client
	channel string
	prefix  string

	mu    sync.Mutex
	queue []string
	kick  chan struct{} // holds a token while queue is not empty
}

// subscribe starts the listener if it is not running and returns a
// subscription to channel's payloads that start with prefix. The first
// entry a subscription receives is a resync marker, once the listener
// listens, so a subscriber reads the state it follows after it is sure to
// see later changes. It returns ErrClosed after Close.
func (c *Client) subscribe(channel, prefix string) (*subscription, error) {
	if err := c.core.Enter(); err != nil {
		return nil, err
	}
	defer c.core.Wg.Done()
	sub := &subscription{c: c, channel: channel, prefix: prefix, kick: make(chan struct{}, 1)}
	n := &c.notifier
	n.mu.Lock()
	if n.subs == nil {
		n.subs = make(map[*subscription]struct{})
	}
	n.subs[sub] = struct{}{}
	start := !n.started
	n.started = true
	n.mu.Unlock()
	if start {
		c.core.Mu.Lock()
		if c.core.Closed {
			c.core.Mu.Unlock()
			return nil, ErrClosed
		}
		c.core.Wg.Add(1)
		c.core.Mu.Unlock()
		go c.listen()
	} else if c.listening.Load() {
		sub.push("")
	}
	return sub, nil
}

// close ends the subscription.
func (sub *subscription) close() {
	n := &sub.c.notifier
	n.mu.Lock()
	delete(n.subs, sub)
	n.mu.Unlock()
}

// push queues a payload and wakes the subscriber.
func (sub *subscription) push(payload string) {
	sub.mu.Lock()
	sub.queue = append(sub.queue, payload)
	sub.mu.Unlock()
	select {
	case sub.kick <- struct{}{}:
	default:
	}
}

// next returns the queued payloads, waiting until there is one, ctx ends
// (context.Cause(ctx)), the Client closes (ErrClosed) or the timer fires
// (a nil slice and no error). A nil timer never fires.
func (sub *subscription) next(ctx context.Context, timer <-chan time.Time) ([]string, error) {
	select {
	case <-sub.kick:
	case <-timer:
		return nil, nil
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	case <-sub.c.core.Closing.Done():
		return nil, ErrClosed
	}
	return sub.take(), nil
}

// poll returns the queued payloads without waiting.
func (sub *subscription) poll() []string {
	select {
	case <-sub.kick:
		return sub.take()
	default:
		return nil
	}
}

// take returns and empties the queued payloads; call it after receiving
// from kick.
func (sub *subscription) take() []string {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	q := sub.queue
	sub.queue = nil
	return q
}

// dispatch hands a notification, or a resync marker (payload "" on no
// channel), to the subscriptions that want it.
func (n *notifier) dispatch(channel, payload string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for sub := range n.subs {
		if channel == "" || sub.channel == channel && strings.HasPrefix(payload, sub.prefix) {
			sub.push(payload)
		}
	}
}

// listen runs the listener until the Client closes.
func (c *Client) listen() {
	defer c.core.Wg.Done()
	backoff := listenerMinBackoff
	for c.core.Closing.Err() == nil {
		err := c.listenOnce()
		c.listening.Store(false)
		if c.core.Closing.Err() != nil {
			return
		}
		c.core.Cfg.WarnLogger().Warn("pgcoord: listener connection failed; reopening", "error", err, "retry_in", backoff)
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-c.core.Closing.Done():
			t.Stop()
			return
		}
		backoff = min(2*backoff, listenerMaxBackoff)
	}
}

// listenOnce opens the listener's connection, listens, and delivers
// notifications until the connection fails or the Client closes.
func (c *Client) listenOnce() error {
	ctx, cancel := context.WithTimeout(c.core.Closing, c.core.ConnectTimeout)
	conn, _, err := c.core.Connect(ctx)
	cancel()
	if err != nil {
		return err
	}
	defer core.CloseConn(conn, c.core.Cfg.LossDeadline)
	ctx, cancel = context.WithTimeout(c.core.Closing, c.core.Cfg.LossDeadline)
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{leaderChannel}.Sanitize()+"; LISTEN "+pgx.Identifier{semaphoreChannel}.Sanitize())
	cancel()
	if err != nil {
		return err
	}
	c.listening.Store(true)
	c.notifier.dispatch("", "")

	// Wait with no context to watch: Close ends the wait through the
	// socket's deadline, which leaves nothing to cancel on the server.
	stop := context.AfterFunc(c.core.Closing, func() {
		_ = conn.PgConn().Conn().SetReadDeadline(time.Now())
	})
	defer stop()
	for {
		nt, err := conn.WaitForNotification(context.Background())
		if err != nil {
			if c.core.Closing.Err() != nil {
				return ErrClosed
			}
			return err
		}
		c.notifier.dispatch(nt.Channel, nt.Payload)
	}
}
