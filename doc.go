// Package pgcoord coordinates processes through the PostgreSQL they already
// use: session- and transaction-level advisory locks, exclusive and shared,
// on hashed or numeric keys, taken in one canonical order so multi-key locks
// never deadlock, with fencing tokens for writes that must not come from a
// holder that has lost its lock.
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
// [Session] holds many locks on one connection. Such a lock belongs to a
// server backend, so everything follows from keeping that backend's
// connection to ourselves and knowing when it is gone:
//
//   - A connection that may hold a lock is never handed back to a pool or
//     to other code. pgcoord opens its own connections from the pool's
//     configuration, keeps up to a few idle ones for reuse, and closes one
//     on any doubt. (A pool's Release does not reset a session: a lock left
//     on a pooled connection is silently re-entered by its next borrower.)
//   - An error from a blocking acquire does not mean "not acquired":
//     PostgreSQL may grant the lock just before it processes the cancel. So
//     a cancelled or failed wait is followed by an unlock of the keys asked
//     for, on the same connection, before the error is returned; if that
//     fails too, the connection is closed. A failed acquire leaves nothing
//     behind.
//   - Unlock works with an already-cancelled context (it sends the release
//     with a fresh, bounded one). When it returns nil, the key is free on
//     the server.
//   - Goroutines of one Client that want the same key queue in the process,
//     so only one of them at a time waits on the server: a hundred waiters
//     use one connection. Two Lock handles for one key in one Client
//     exclude each other like a sync.Mutex, and PostgreSQL cannot see a
//     cycle among them, so take several keys with LockAll.
//   - A server in recovery (a hot standby) is refused with [ErrReadOnly]:
//     its advisory locks exclude nobody on the primary. A backend that
//     changes under a session, as behind PgBouncer in transaction pooling
//     mode, ends the session with [ErrTransactionPooling].
//
// # The lease: how long a lost lock can look held
//
// A holder must learn that it lost a lock before anyone else can take it.
// Two clocks make that true, with the loss deadline L ([WithLossDeadline],
// default 5s) and the heartbeat interval H ([WithHeartbeat], default 1s):
//
//   - Server side: every pinned connection sets, on its own backend,
//     tcp_keepalives_idle = L/2, tcp_keepalives_interval = 1s and a count
//     that together with tcp_user_timeout = 2L make the server drop a
//     client it has not heard from for 2L (10s by default), and with it the
//     client's locks. client_connection_check_interval = 1s makes a backend
//     that waits for a lock notice a closed client within a second.
//     statement_timeout, lock_timeout, idle_session_timeout and
//     idle_in_transaction_session_timeout are set to 0 so that a role's
//     defaults cannot end a holder. None of this needs a privilege.
//   - Client side: a heartbeat runs a tiny query every H when the
//     connection is idle; any statement that succeeds proves the connection
//     alive as of when it was sent. If nothing has proved it alive for L,
//     the session declares its locks lost. The server heard from the client
//     no earlier than that, so it keeps the locks until at least 2L: the old
//     holder gives up at least L before anyone else can acquire.
//   - While a blocking acquire waits on the connection the heartbeat cannot
//     run. The client socket's TCP keepalives (every H) and TCP_USER_TIMEOUT
//     (L) then end the wait with an error within about H+L of the network
//     going silent, still before the server's 2L.
//
// A backend that is terminated (pg_terminate_backend, a server restart) is
// noticed at the next heartbeat: within H plus a round trip. When a session
// is lost its Done channel closes, Err returns an error wrapping
// [ErrLockLost] and the cause, every Lock on it ends the same way, the
// context of every [Client.Do] callback on it is cancelled, and the
// connection is closed.
//
// No clock covers a holder that is paused (GC, SIGSTOP, a slow disk) while
// it acts on what it thinks it holds. For that, take the lock
// [WithFence] and have the protected write check the fence with
// [CheckFence] in its own transaction; see fence.go and [Migrate].
package pgcoord
