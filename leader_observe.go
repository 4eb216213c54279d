package pgcoord

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
)

// Who leads
//
// Election.Leader answers once, from the leaders row and pg_locks: a leader
// is reported only while its recorded backend holds the election's lock.
// Election.Observe follows the changes: the Client's listener delivers the
// notifications a leader sends as it starts and ends, and a check every
// heartbeat interval catches a leader that died without a word.

// Leader returns the current leader. It returns an error wrapping
// ErrNoLeader when nobody leads: a leader is reported only while its
// backend holds the election's lock, so never a dead one. A new leader is
// reported as soon as it has recorded its term, which it does while it
// takes the election's guard: its fn starts only after that (normally
// within a round trip; up to the loss deadline later after a predecessor
// that did not free the guard, that led without it, or whose term a
// restart or failover ended), and the previous leader's context may still
// be live until then. To route work to a leader, have the leader itself
// announce when it is ready, or expect it to refuse work until its fn
// runs. ctx bounds the query, which runs on the Client's pool. Other
// errors: ErrClosed after Close, ErrNotMigrated without the tables of
// Migrate, and query errors.
func (e *Election) Leader(ctx context.Context) (LeaderInfo, error) {
	if ctx == nil {
		return LeaderInfo{}, core.Errorf("leader election %q: ctx is nil", e.name)
	}
	info, err := e.leader(ctx)
	if err != nil {
		return LeaderInfo{}, core.Errorf("leader election %q: %w", e.name, err)
	}
	return info, nil
}

// leader is Leader, its errors not yet naming the election.
func (e *Election) leader(ctx context.Context) (LeaderInfo, error) {
	if e.err != nil {
		return LeaderInfo{}, e.err
	}
	if err := e.c.core.RefuseClosed(); err != nil {
		return LeaderInfo{}, err
	}
	classid, objid, _ := e.key.LockColumns()
	var info LeaderInfo
	var term int64
	err := e.c.core.OnPool(ctx, func(b *pgx.Batch) {
		b.Queue(`SELECT l.identity, l.term, l.since, l.pid FROM `+e.c.core.Cfg.Table("leaders")+` AS l
			WHERE l.name = $1 AND EXISTS (SELECT 1 FROM pg_locks AS k
				WHERE k.locktype = 'advisory' AND k.granted AND k.pid = l.pid
				AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
				AND k.classid::bigint = $2 AND k.objid::bigint = $3 AND k.objsubid = 1)`,
			e.name, int64(classid), int64(objid)).QueryRow(func(row pgx.Row) error {
			return row.Scan(&info.Identity, &term, &info.Since, &info.PID)
		})
	})
	info.Term = Term(term)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return LeaderInfo{}, ErrNoLeader
	case err != nil:
		return LeaderInfo{}, core.NotMigrated(e.c.core.Cfg, "read the leaders row", err)
	}
	return info, nil
}

// Observe returns a channel that delivers the election's leaders as they
// change, in order: first the current leader (or the zero LeaderInfo when
// nobody leads), then every new leader, and the zero LeaderInfo when a
// leader ends and nobody has followed yet. A new leader is delivered when
// it has recorded its term, which may be before its fn starts (see
// Leader). New leaders and resignations
// arrive by NOTIFY, as they commit; a leader that died without resigning
// is noticed by a check every heartbeat interval (WithHeartbeat), once the
// server has freed its lock. Observing never slows the candidates: changes
// queue in the process until the receiver takes them. The channel is
// closed when ctx ends or the Client closes, or at once if the Election is
// invalid. Observe uses the Client's listener connection and one query on
// the pool per heartbeat interval, each bounded by the loss deadline and
// by Close. A read that fails (the tables of Migrate missing, a pool with
// no free connection, a connection error, a role that may not read the
// leaders table) is delivered as a LeaderInfo whose Err says why, once
// while the same error lasts, and logged; it is tried again every
// heartbeat interval, and once a read works the leader (or the zero
// LeaderInfo) is delivered again, with any change missed meanwhile. An
// invalid Election, or a closed Client, delivers its error in one
// LeaderInfo, then the channel is closed.
func (e *Election) Observe(ctx context.Context) <-chan LeaderInfo {
	err := e.err
	if err == nil && ctx == nil {
		err = core.Errorf("ctx is nil")
	}
	if err == nil {
		err = e.c.core.Enter()
	}
	if err != nil {
		err = core.Errorf("observe election %q: %w", e.name, err)
		out := make(chan LeaderInfo, 1)
		out <- LeaderInfo{Err: err}
		close(out)
		return out
	}
	sub, err := e.c.subscribe(leaderChannel, e.prefix)
	if err != nil {
		e.c.core.Wg.Done()
		out := make(chan LeaderInfo, 1)
		out <- LeaderInfo{Err: core.Errorf("observe election %q: %w", e.name, err)}
		close(out)
		return out
	}
	out := make(chan LeaderInfo)
	go func() {
		defer e.c.core.Wg.Done()
		defer close(out)
		defer sub.close()
		e.observe(ctx, sub, out)
	}()
	return out
}

// observer is the state of one Observe.
type observer struct {
	cur     LeaderInfo // zero: no leader
	maxTerm Term
	started bool
	failed  bool // the last report was an error: report the next leader, or none, even if unchanged
	pending []LeaderInfo
}

func (e *Election) observe(ctx context.Context, sub *subscription, out chan<- LeaderInfo) {
	var o observer
	tick := time.NewTicker(e.c.core.Cfg.Heartbeat)
	defer tick.Stop()
	// Reads end with ctx or with the Client's closing, whichever comes
	// first, and each within the loss deadline (a pool with no free
	// connection must not hold Observe, or Close, for longer).
	qctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(e.c.core.Closing, cancel)()
	// resync: notifications may have been lost since the last read that
	// succeeded, so the next read takes the leader it finds. It stays set
	// until a read succeeds.
	resync := true
	failed := "" // the error of the last read, if it failed
	check := func(lost bool) {
		resync = resync || lost
		rctx, cancel := context.WithTimeout(qctx, e.c.core.Cfg.LossDeadline)
		info, err := e.Leader(rctx)
		cancel()
		switch {
		case errors.Is(err, ErrNoLeader):
			o.none()
			resync = false
		case err == nil:
			if resync || !o.started || !e.c.listening.Load() {
				// A new leader is taken from its notification, which
				// keeps the order; read here only when notifications may
				// have been lost.
				o.leader(info)
			}
			resync = false
		case qctx.Err() == nil && err.Error() != failed:
			failed = err.Error() // reported and logged once while it lasts
			e.c.core.Cfg.WarnLogger().Warn("pgcoord: observe: read the leader; trying again every heartbeat", "election", e.name, "error", err)
			o.fail(err)
			return
		}
		if err == nil || errors.Is(err, ErrNoLeader) {
			failed = ""
		}
	}
	check(true)
	for {
		var send chan<- LeaderInfo
		var head LeaderInfo
		if len(o.pending) > 0 {
			send, head = out, o.pending[0]
		}
		select {
		case send <- head:
			o.pending = o.pending[1:]
		case <-tick.C:
			check(false)
		case <-sub.kick:
			for _, p := range sub.take() {
				e.observed(&o, p, check)
			}
		case <-ctx.Done():
			return
		case <-e.c.core.Closing.Done():
			return
		}
	}
}

// observed applies one payload of the election's channel.
func (e *Election) observed(o *observer, payload string, check func(bool)) {
	if payload == "" {
		check(true)
		return
	}
	rest := strings.TrimPrefix(payload, e.prefix)
	kind, rest, _ := strings.Cut(rest, ":")
	switch kind {
	case "lead":
		f := strings.SplitN(rest, ":", 4)
		if len(f) != 4 {
			return
		}
		term, err1 := strconv.ParseInt(f[0], 10, 64)
		pid, err2 := strconv.ParseInt(f[1], 10, 32)
		micros, err3 := strconv.ParseInt(f[2], 10, 64)
		if err1 != nil || err2 != nil || err3 != nil {
			return
		}
		o.leader(LeaderInfo{Identity: f[3], Term: Term(term), Since: time.UnixMicro(micros), PID: int32(pid)})
	case "end":
		if term, err := strconv.ParseInt(rest, 10, 64); err == nil && Term(term) == o.cur.Term {
			o.none()
		}
	}
}

// fail reports that the election could not be read.
func (o *observer) fail(err error) {
	o.failed = true
	o.pending = append(o.pending, LeaderInfo{Err: err})
}

func (o *observer) leader(info LeaderInfo) {
	if info.Term > o.maxTerm || o.failed && info.Term == o.maxTerm {
		o.maxTerm, o.cur, o.started, o.failed = info.Term, info, true, false
		o.pending = append(o.pending, info)
	}
}

func (o *observer) none() {
	if !o.started || o.cur.PID != 0 || o.failed {
		o.cur, o.started, o.failed = LeaderInfo{}, true, false
		o.pending = append(o.pending, LeaderInfo{})
	}
}
