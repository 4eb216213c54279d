// Package xactsql lets package pgcoordsql run package pgcoord's
// transaction-level lock and fence code on a database/sql transaction, so
// that the canonical key order, the statements, the chunking and the errors
// exist once.
//
// The code stays in package pgcoord, written against the driver-neutral
// [Tx] and [Txn] interfaces; package pgcoord adapts a pgx.Tx to them, and
// package pgcoordsql a *sql.Tx. Package pgcoord cannot be imported from
// here (it imports this package), so it hands its functions over in
// [Registered], an [Impl] instantiated with its own Key, Term and
// FenceOption types, when it is initialised. Go initialises an imported
// package before the package that imports it, so [Registered] is set before
// any code of pgcoordsql runs.
package xactsql

import (
	"context"
	"errors"
)

// Tx runs statements in one open transaction. Exec and QueryRow return nil
// only if the statement succeeded on a connection the driver keeps: a
// driver that closes the connection when ctx ends during a statement, even
// one that succeeded, must be answered with an error (package pgcoordsql
// returns one wrapping ctx's whenever ctx is done when the statement
// returns).
type Tx interface {
	// Exec runs sql with args and discards what it returns.
	Exec(ctx context.Context, sql string, args ...any) error
	// QueryRow runs sql with args and scans the first row into dest. It
	// returns an error wrapping ErrNoRows when there is no row.
	QueryRow(ctx context.Context, sql string, args []any, dest ...any) error
}

// Txn is a transaction that InTx begins, and ends with Commit or Rollback.
type Txn interface {
	Tx
	// Commit commits the transaction; ctx bounds it where the driver
	// takes one.
	Commit(ctx context.Context) error
	// Rollback rolls the transaction back; ctx bounds it where the driver
	// takes one.
	Rollback(ctx context.Context) error
}

// ErrNoRows is what Tx.QueryRow returns, wrapped or not, for a query that
// returned no row, whatever the driver's own error for it.
var ErrNoRows = errors.New("no rows in result set")

// Mode selects the lock a call takes.
type Mode uint8

// The modes of XactLock, XactRLock, XactTryLock and XactTryRLock.
const (
	Lock Mode = iota
	RLock
	TryLock
	TryRLock
)

// Impl holds package pgcoord's code, instantiated with its Key, Term and
// FenceOption types.
type Impl[Key, Term, FenceOption any] struct {
	// Acquire validates keys and takes them in tx in canonical order with
	// mode, exactly as pgcoord.XactLock and its siblings do; op names the
	// function in errors. A nil tx is the caller's to check.
	Acquire func(ctx context.Context, op string, mode Mode, tx Tx, keys []Key) error
	// InTx validates keys, begins a transaction with begin, takes the keys
	// exclusively, calls fn and commits, rolling back on any error or
	// panic, exactly as pgcoord.InTx does; op names the function in errors.
	InTx func(ctx context.Context, op string, begin func(context.Context) (Txn, error), keys []Key, fn func(Txn) error) error
	// CheckFence is pgcoord.CheckFence on tx. A nil tx is the caller's to
	// check.
	CheckFence func(ctx context.Context, tx Tx, key Key, fence Term, opts []FenceOption) error
	// Subject names keys as pgcoord's errors do, after the operation:
	// "pgcoord: <operation> <subject>: <cause>".
	Subject func(keys []Key) string
}

// Registered is package pgcoord's Impl[pgcoord.Key, pgcoord.Term,
// pgcoord.FenceOption], set when package pgcoord is initialised.
var Registered any
