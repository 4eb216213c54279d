// Package core is pgcoord's lock core: a session-level advisory lock from
// the call of an acquire to the statement that takes the key, and what
// that statement needs: the Client's dedicated connections and the rule
// that routes a statement to one of them, the in-process queue per key,
// the statements that take, wait for and free keys, the liveness of a
// connection (heartbeat, lease, cancel), the lock handles and the fences
// issued with them.
//
// The root package, pgcoord, is the face of this package: its exported
// types (Client, Session, Lock, Key) hold this package's values and hand
// their calls over, and they document the promises. Elections, semaphores
// and transaction-level locks are built on this package there. Nothing
// here knows of them, nor of the exported API: the imports run one way,
// from the root package to this one.
//
// The names exported here serve the root package; the package is internal,
// so no user can import them.
package core
