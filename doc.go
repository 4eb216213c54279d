// Package pgcoord coordinates processes through the PostgreSQL they already
// use: session- and transaction-level advisory locks, exclusive and shared,
// on hashed or numeric keys, taken in one canonical order so multi-key locks
// never deadlock, with fencing tokens for writes that must not come from a
// holder that has lost its lock. It needs PostgreSQL 13 or newer and pgx v5;
// no extension, no superuser.
//
// # Getting started
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	if err != nil {
//		return err
//	}
//	c, err := pgcoord.New(pool)
//	if err != nil {
//		return err
//	}
//	defer c.Close(context.Background())
//
//	err = c.Do(ctx, pgcoord.HashKey("report", "daily"), func(ctx context.Context) error {
//		return buildReport(ctx) // ctx is cancelled if the lock is lost
//	})
//
// # Which function to use
//
//   - One job at a time across a fleet: [Client.Do] (the lock is held for
//     the callback, whose context ends if the lock is lost), or
//     [Client.Lock] and [Lock.Unlock]. [Client.TryLock] returns [ErrLocked]
//     instead of waiting.
//   - Readers and writers: [Client.RLock] and [Client.TryRLock] take a key
//     shared; Lock excludes them.
//   - Several keys at once without deadlocks: [Client.LockAll] on a
//     connection, [XactLock] or [InTx] in a transaction.
//   - A lock that lives as long as a transaction the code already has:
//     [XactLock], [XactTryLock], [XactRLock]; [InTx] and [InTxOptions]
//     begin, lock, call and commit. These work behind PgBouncer in
//     transaction pooling mode.
//   - Many locks on one connection of its own: [Client.NewSession].
//   - One leader among identical processes: [Client.Election] and
//     [Election.Run] (the function runs while leading; its context ends
//     when the leadership does); [Election.Leader] and [Election.Observe]
//     tell who leads; [Election.RequestResign] moves the leadership. Terms
//     are fences for [CheckFence]. Needs [Migrate].
//   - At most n holders across the fleet: [Client.Semaphore],
//     [Semaphore.Acquire] and [Permit.Release]; [Semaphore.Holders] lists
//     them, [Semaphore.SetLimit] changes n. Needs [Migrate].
//   - Writes that must not come from a holder that has lost its lock: take
//     it [WithFence] and check [Lock.Fence] with [CheckFence] in the
//     write's transaction; [Migrate] creates the table fences need.
//   - Keys: [HashKey] from strings (a frozen algorithm, documented in the
//     README so other languages can compute it), [Int64Key] and [PairKey]
//     for PostgreSQL's two key spaces. A Key is text in JSON
//     ([Key.MarshalText]).
//
// # Operations
//
// [Client.Locks] lists every holder and waiter of an advisory lock in the
// database, from any process, with backend, application name and times;
// [WithKeyNames] gives keys readable names. [Client.Terminate] force-releases
// a stuck pgcoord backend's locks.
//
// The command cmd/pgcoord does this, and more, from a shell, reading
// DATABASE_URL or the libpq environment, with --json for scripts:
//
//   - pgcoord locks: holders and waiters, by key or name;
//   - pgcoord key NAME: the key of a name and its pg_locks columns;
//   - pgcoord release --pid N: terminate a backend to free its locks;
//   - pgcoord leader ELECTION: who leads, with term, since and backend pid
//     (--resign asks the leader to step down);
//   - pgcoord elections: every election and whether its leader still leads;
//   - pgcoord semaphores: each semaphore's limit, permits held and queue
//     (--holders lists the holders);
//   - pgcoord migrate: apply [Migrate] to a schema;
//   - pgcoord demo: hold a few locks until interrupted, to look at.
//
// [WithHooks] calls functions of the application on every acquire,
// release, contention and loss (for metrics; examples/metrics shows
// Prometheus and OpenTelemetry mappings), off the locking path. [WithLogger]
// takes a log/slog logger: lock operations at Debug, losses at Warn.
// Without it, losses still go to slog.Default() at Warn: a lost lock is
// never silent.
//
// # Errors
//
// Every error that pgcoord makes reads, on one line,
//
//	pgcoord: <operation> <subject>: <cause>
//
// for example "pgcoord: try lock int64:42: key is locked by another
// holder", "pgcoord: campaign election "jobs": context deadline exceeded".
// The operation is what was asked, in lower-case words (lock, try lock,
// unlock, xact lock, campaign, acquire, release, check fence, ...); the
// subject is what it was asked of: the keys as [Key.String] writes them
// (a list in brackets), election "name", semaphore "name", or backend N;
// the cause is the sentinel's text, then what PostgreSQL or the network
// said. When the caller's ctx ended a wait, the cause is ctx's error (or
// the cause given to its cancel), not the statement pgcoord cancelled to
// honour it. Do and InTx return the callback's own error as it is. Test
// for the sentinels ([ErrLocked], [ErrLockLost], [ErrClosed], ...) with
// errors.Is; errors that came from PostgreSQL keep the *pgconn.PgError
// reachable with errors.As.
//
// # Locks that live as long as a transaction
//
// Inside a transaction the application already has, [XactLock] takes keys
// that the transaction's commit or rollback releases. [InTx] begins,
// locks, runs a function and commits. These work behind PgBouncer in
// transaction pooling mode.
//
// # Locks that live as long as a connection
//
// A [Client] takes session-level locks: [Client.Lock], [Client.TryLock],
// [Client.RLock], [Client.TryRLock], [Client.LockAll] and [Client.Do]. A
// [Session] holds many locks on one connection of its own. Such a lock
// belongs to a server backend, so everything follows from keeping that
// backend's connection to ourselves and knowing when it is gone:
//
//   - A connection that may hold a lock is never handed back to a pool or
//     to other code. pgcoord opens its own connections through the pool's
//     connect path (its dialer and BeforeConnect/AfterConnect hooks) and
//     closes one on any doubt. (A pool's Release does not reset a session:
//     a lock left on a pooled connection is silently re-entered by its next
//     borrower.)
//   - Connections are the scarce thing: a Client's locks share a few
//     backends. An acquire first tries its keys on a shared backend (one
//     round trip, no new connection, when they are free); only a wait for
//     keys held elsewhere needs a backend, and at most [WithMaxWaits] wait
//     at once. A Client uses at most [WithSharedBackends] + WithMaxWaits
//     connections (2 + 4 by default) however many keys it holds;
//     [Client.Stat] shows them. A lost backend ends every lock on it.
//     Tries and releases of single keys that goroutines send to one
//     backend while it is busy go out together, as one statement, each
//     caller getting its own key's answer, so many goroutines on keys of
//     their own wait for fewer round trips.
//   - A backend is one session to PostgreSQL, whichever goroutines its
//     locks belong to; the server's deadlock detector, lock_timeout and
//     lock queue see the backend. So a wait for a key held elsewhere runs
//     only on a backend that holds nothing (or, for the head of a
//     semaphore's queue, nothing but the queue key, which only waiters that
//     hold nothing wait for), and every statement that can
//     wait (a lock, or a fence that waits for a transaction that checked
//     the old one) runs in slices that end with an answer within the lease.
//     No goroutine sees [ErrDeadlock] unless its application has a lock
//     cycle, no goroutine's lock is lost because of another's wait, timeout
//     or error, and a Client's limits delay a blocking acquire but never
//     deadlock goroutines whose lock order is consistent: one that finds no
//     backend to wait on tries its keys again until it can wait. A
//     [Session] is different by design: its locks and waits are one
//     session to the server, as the application chose.
//   - A blocking acquire rides through a lost connection, a server restart
//     or a failover: it keeps trying to reach a writable server, backing
//     off, until its ctx ends. A try fails fast.
//   - An error from a blocking acquire does not mean "not acquired":
//     PostgreSQL may grant the lock just before it processes the cancel. A
//     backend's count of each key is kept at 0 or 1 and every decision
//     about a key is made together with the statement that changes it, so
//     a failed acquire releases exactly what its own statement may have
//     taken, on the same connection, before the error is returned; if that
//     fails too, the connection is closed. A failed acquire leaves nothing
//     behind.
//   - A cancelled wait returns within a few milliseconds of ctx's end: the
//     cancel request is sent at once, and the connection is used again as
//     soon as the server has acted on it, which is also exactly when a
//     late cancel can no longer hit the next statement. A backend that
//     cannot act on it (stopped, or out of reach) ends the wait when the
//     lease declares it lost, within the loss deadline.
//   - Unlock works with an already-cancelled context (it sends the release
//     with a fresh, bounded one). When it returns nil, the key is free on
//     the server, or handed to another goroutine of the same Client that
//     was waiting for it (see [WithHandoff]).
//   - Goroutines of one Client that want the same key queue in the process,
//     in arrival order, so only one of them at a time goes to the server: a
//     hundred waiters use no connection while they queue. Two Lock handles
//     for one key in one Client exclude each other like a sync.Mutex, and
//     PostgreSQL cannot see a cycle among them, so take several keys with
//     LockAll.
//   - A server in recovery (a hot standby) is refused with [ErrReadOnly]:
//     its advisory locks exclude nobody on the primary. A connection pooler
//     (PgBouncer, pgcat, RDS Proxy: anything that answers for the server
//     with a backend pid of its own) is refused with [ErrTransactionPooling]
//     before anything is locked or set on a pooled backend, unless
//     [WithSessionPooler] says it runs in session mode; even then a second
//     connection through the pooler that lands on the session's backend
//     gives transaction pooling away. Every statement that takes or frees a
//     key carries the check "on the session's own backend" and does nothing
//     elsewhere. What remains undetectable with WithSessionPooler: a pooler
//     that pools transactions but happens to give the probe another backend
//     and to keep running the session's statements on the session's own;
//     another client of the pooler can then run on that backend between
//     them, and re-enter its locks, until a statement lands elsewhere and
//     ends the session. Behind transaction pooling, use the Xact functions.
//
// # The lease: how long a lost lock can look held
//
// With the loss deadline L ([WithLossDeadline], default 5s) and the
// heartbeat interval H ([WithHeartbeat], default 1s):
//
//   - Server side: every pinned connection sets, on its own backend,
//     tcp_keepalives_idle = L/2, tcp_keepalives_interval = 1s and a count
//     that together with tcp_user_timeout = 2L make the server drop a
//     client it has not heard from for 2L (10s by default), and with it the
//     client's locks. client_connection_check_interval = 1s makes a backend
//     that waits for a lock notice a closed client within a second.
//     statement_timeout, lock_timeout, idle_session_timeout and
//     idle_in_transaction_session_timeout are set to 0 so that a role's
//     defaults cannot end a holder. None of this needs a privilege. On
//     PostgreSQL 13, client_connection_check_interval and
//     idle_session_timeout do not exist and are left out.
//   - Client side: a heartbeat runs a tiny query every H when the
//     connection is idle; any answer from the server proves the connection
//     alive as of when the statement was sent. If nothing has proved it
//     alive for L, the session declares its locks lost, whatever runs on
//     the connection. The server heard from the client no earlier than
//     that, so it keeps the locks until at least 2L.
//   - A blocking acquire waits on the server in slices of (L-H)/2
//     (lock_timeout, for that statement only; a statement that waits for
//     several keys is cancelled when its slice is over): each slice ends
//     with an answer, which proves the connection alive, and the wait goes
//     on. Whatever a slice took before it ended is released before the
//     next, so a backend's count of each key stays 0 or 1. Issuing a fence,
//     which waits while a transaction that checked the previous fence is
//     open, runs in slices the same way, and so does a leader's term. Their
//     commit may also wait for a synchronous standby: a slice that cuts
//     that wait short leaves the token committed on the primary only
//     (PostgreSQL answers with a warning, not an error), so the token is
//     withheld and the next slice issues a greater one; a fence or term is
//     handed out only once the standby has confirmed its commit, and a
//     stalled standby delays tokens, never the lease. So a lock held on a backend keeps
//     its loss deadline while another statement waits on the same backend,
//     even behind a proxy that keeps the client's socket alive. The price: a wait that lasts several slices
//     rejoins PostgreSQL's queue for the key at each slice, so among
//     waiters of different processes the order is not strictly first come
//     first served.
//
// What the holder learns, and when:
//
//   - A silent network: the holder declares the loss within L; the server
//     frees the locks after about 2L. So the old holder knows it lost the
//     lock at least L before anyone else can take it.
//   - A terminated backend (pg_terminate_backend) or a server restart or
//     crash: the server frees the locks at once, and the holder notices at
//     its next heartbeat or statement, within H plus a round trip. Another
//     client can take the lock before the old holder knows.
//   - A failover to a standby: the new primary has none of the old one's
//     advisory locks; holders notice when their connection fails, and
//     sessions refuse the new server until they reconnect.
//
// When a session is lost its Done channel closes, Err returns an error
// wrapping [ErrLockLost] and the cause, every Lock on it ends the same way,
// the context of every [Client.Do] callback on it is cancelled, and the
// connection is closed. Only a broken connection or a lost lease loses a
// session: an acquire chosen as a deadlock victim, cancelled or timed out
// fails alone, leaving nothing of its keys behind, and the session's other
// locks live.
//
// No clock covers a holder that is paused (GC, SIGSTOP, a slow disk) while
// it acts on what it thinks it holds, nor the cases above where the lock is
// freed before the holder knows. For those, take the lock [WithFence] and
// have the protected write check the fence with [CheckFence] in its own
// transaction; see fence.go and [Migrate].
package pgcoord
