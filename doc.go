// Package pgcoord coordinates processes through PostgreSQL: session- and
// transaction-level advisory locks, exclusive and shared, over hashed and
// two-part keys, taken in one canonical order so multi-key locks never
// deadlock, with fencing tokens for writes that must not come from a holder
// that has lost its lock.
package pgcoord
