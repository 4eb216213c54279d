package pgcoordsql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"

	"github.com/pgcoord/pgcoord"
	"github.com/pgcoord/pgcoord/internal/xactsql"
)

// impl is package pgcoord's code for transactions, run here on a *sql.Tx.
var impl = xactsql.Registered.(xactsql.Impl[pgcoord.Key, pgcoord.Term, pgcoord.FenceOption])

// XactLock takes exclusive transaction-level advisory locks on keys in tx,
// waiting until every key is free, as [pgcoord.XactLock] does in a pgx.Tx.
// The keys are validated, deduplicated and taken in the canonical order in
// one statement, so concurrent callers that lock overlapping sets of keys,
// each set in one call, cannot deadlock on them. The locks are released
// when tx commits or rolls back, and cannot be released earlier. Only a
// *sql.Tx is accepted: outside a transaction each statement is its own
// transaction, and the lock would be gone when XactLock returned.
//
// ctx governs the wait. If ctx ends during it, the driver sends the server
// a cancel request, which aborts tx and so releases all of its keys (see
// the package documentation for when, per driver, and inside a savepoint),
// and XactLock returns an error wrapping the context's error; roll tx back
// then. If ctx ends while the statement succeeds (the cancel request comes
// too late), XactLock still returns an error wrapping the context's error,
// never nil: the driver may be closing the connection (lib/pq always does),
// which ends tx and releases its keys; roll tx back then too. A ctx that is
// done before the statement is sent sends nothing, and
// XactLock returns an error wrapping the context's error; what becomes of tx
// depends on the context tx was begun with. If that context is still live
// (ctx is another one), tx and its keys are as they were and tx can go on
// and commit. If it is done too (ctx is the one given to BeginTx, or derived
// from it), database/sql rolls tx back by itself as soon as that context
// ends, whatever XactLock does: the keys tx held are released then, and
// Commit returns sql.ErrTxDone (or the context's error). So pass the
// context tx was begun with, or one derived from it: if tx's own context
// ends while XactLock waits under another ctx that stays live, database/sql
// rolls tx back right after the statement, and XactLock can return nil for
// keys already released (Commit then returns sql.ErrTxDone). Every error from the
// server aborts tx and releases its keys as well: do not go on with tx after
// an error.
//
// Isolation: if tx is REPEATABLE READ or SERIALIZABLE, its snapshot was
// taken by its first statement, at the latest when the lock statement
// started, before the keys were granted, so tx does not see what the
// previous holder committed: under REPEATABLE READ a read-then-write under
// the keys works on a stale read without any error, under SERIALIZABLE the
// server reports SQLSTATE 40001 instead. Begin tx with
// sql.LevelReadCommitted when the keys must serialise read-then-write work,
// as [InTx] does.
//
// XactLock returns an error wrapping [pgcoord.ErrInvalidKey] for an empty
// or invalid key list and a plain error for a nil tx or a nil ctx (before
// sending anything; neither panics), [pgcoord.ErrDeadlock] if PostgreSQL chose tx as a deadlock
// victim (possible only with keys taken by other calls or with other locks,
// such as row locks), [pgcoord.ErrTooManyLocks] if the server's lock table
// is full, and the context's error when ctx ended the wait; other errors
// are the driver's, wrapped.
func XactLock(ctx context.Context, tx *sql.Tx, keys ...pgcoord.Key) error {
	return acquire(ctx, "xact lock", xactsql.Lock, tx, keys)
}

// XactRLock is [XactLock] for shared locks: any number of transactions can
// hold a key shared at once, and they exclude exclusive holders. PostgreSQL
// queues a new shared request behind a waiting exclusive one, so writers
// are not starved. Everything XactLock says about order, ctx, release and
// errors applies.
func XactRLock(ctx context.Context, tx *sql.Tx, keys ...pgcoord.Key) error {
	return acquire(ctx, "xact read lock", xactsql.RLock, tx, keys)
}

// XactTryLock is [XactLock] without waiting: it tries the keys in canonical
// order, in one statement, and stops at the first key held by another
// transaction, returning an error wrapping [pgcoord.ErrLocked] that names
// it.
//
// Partial success: a failed try is not an error to PostgreSQL, so tx is not
// aborted, and the keys before the held one in canonical order stay locked
// by tx until it ends; the held key and the keys after it were not taken.
// Roll tx back (which releases those keys) and retry later, rather than go
// on holding a subset.
//
// ctx bounds the statement; if it ends during the statement, XactTryLock
// returns an error wrapping the context's error even when the statement
// succeeded, as XactLock does: roll tx back. Other errors are those of
// XactLock, and abort tx as they do there.
func XactTryLock(ctx context.Context, tx *sql.Tx, keys ...pgcoord.Key) error {
	return acquire(ctx, "xact try lock", xactsql.TryLock, tx, keys)
}

// XactTryRLock is [XactTryLock] for shared locks: it fails with an error
// wrapping [pgcoord.ErrLocked] only when another transaction holds a key
// exclusively or is waiting to (PostgreSQL does not let a new shared holder
// overtake a waiting exclusive request). What XactTryLock says about
// partial success applies.
func XactTryRLock(ctx context.Context, tx *sql.Tx, keys ...pgcoord.Key) error {
	return acquire(ctx, "xact try read lock", xactsql.TryRLock, tx, keys)
}

// acquire runs XactLock and its siblings; op is the operation that errors
// name ("xact lock").
func acquire(ctx context.Context, op string, mode xactsql.Mode, tx *sql.Tx, keys []pgcoord.Key) error {
	if tx == nil {
		return errors.New("pgcoord: " + op + " " + impl.Subject(keys) + ": nil *sql.Tx; begin a transaction first, or use pgcoordsql.InTx")
	}
	return impl.Acquire(ctx, op, mode, sqlTx{tx}, keys)
}

// TxBeginner begins a transaction: *sql.DB and *sql.Conn satisfy it.
type TxBeginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// InTx begins a transaction on db, takes exclusive transaction-level locks
// on keys in canonical order (as [XactLock] does), calls fn, and commits. If
// the lock, fn or the commit fails, or fn panics, the transaction is rolled
// back and every key is released; a panic is re-raised after the rollback.
// It is [pgcoord.InTx] for database/sql: the keys are held for exactly the
// life of the transaction.
//
// InTx begins its transaction with sql.LevelReadCommitted (BEGIN ISOLATION
// LEVEL READ COMMITTED), whatever the database's or role's
// default_transaction_isolation: under REPEATABLE READ or SERIALIZABLE the
// snapshot would be taken before the keys are granted, and fn would not see
// what the previous holder committed (see [InTxOptions]).
//
// Round trips: BEGIN, the lock statement (one per 1000 keys for more), fn's
// own and COMMIT, plus whatever the driver adds to run a statement with
// parameters; the package documentation gives the numbers per driver (pgx's
// stdlib in its default mode adds one round trip the first time a
// connection runs a given number of keys).
//
// ctx is the transaction's context: it governs BEGIN, the wait for the keys
// and COMMIT, and database/sql rolls the transaction back as soon as ctx
// ends, even while fn runs. If ctx ends while the lock statement succeeds,
// InTx does not call fn: it rolls back and returns an error wrapping the
// context's error (see [XactLock]). fn should use the ctx it captures for
// its own statements.
//
// fn should return a statement's error rather than ignore it: the error has
// already aborted the transaction and released the keys (see the package
// documentation), so whatever fn does after it is not protected. If fn
// returns nil anyway, COMMIT turns into ROLLBACK and InTx returns the
// driver's error for it.
//
// fn's error is returned unchanged (a rollback error after it is dropped:
// database/sql discards a connection whose rollback failed, which ends the
// transaction on the server). Other errors: those of XactLock
// ([pgcoord.ErrInvalidKey], checked before BEGIN; [pgcoord.ErrDeadlock];
// [pgcoord.ErrTooManyLocks]; the context's error), and BEGIN or COMMIT
// errors from the driver, wrapped. A nil ctx, db or fn is an error (none of
// them panics).
//
// An empty keys (nil or of length 0) takes no lock: InTx then begins, calls
// fn and commits with the same rollback and isolation handling, for a
// transaction that needs no key of its own, such as one that writes only
// after [CheckFence] of a fence held elsewhere.
func InTx(ctx context.Context, db TxBeginner, keys []pgcoord.Key, fn func(tx *sql.Tx) error) error {
	return inTx(ctx, "in tx", db, &sql.TxOptions{Isolation: sql.LevelReadCommitted}, keys, fn)
}

// InTxOptions is [InTx] with a transaction begun with opts (isolation level,
// read-only), as db.BeginTx takes them. Nil opts, or opts.Isolation
// sql.LevelDefault, mean sql.LevelReadCommitted, as in InTx, not the
// database's default. Everything InTx says about keys, ctx, rollback and
// errors applies. A read-only transaction can take the locks: advisory
// locks are not writes.
//
// An explicit sql.LevelRepeatableRead or sql.LevelSerializable is
// honoured, but the keys then do not serialise read-then-write work: the
// transaction's snapshot is taken when the lock statement starts, before
// the keys are granted, so fn does not see what the previous holder
// committed. Under REPEATABLE READ fn silently reads stale data (two
// holders can both withdraw the same money); under SERIALIZABLE the server
// reports a serialization failure (SQLSTATE 40001) from fn or COMMIT
// instead of a wrong result, which rolls back and releases the keys like
// any other error; InTxOptions does not retry. Use READ COMMITTED unless fn
// needs REPEATABLE READ or SERIALIZABLE for reasons of its own.
func InTxOptions(ctx context.Context, db TxBeginner, opts *sql.TxOptions, keys []pgcoord.Key, fn func(tx *sql.Tx) error) error {
	o := sql.TxOptions{Isolation: sql.LevelReadCommitted}
	if opts != nil {
		o.ReadOnly = opts.ReadOnly
		if opts.Isolation != sql.LevelDefault {
			o.Isolation = opts.Isolation
		}
	}
	return inTx(ctx, "in tx", db, &o, keys, fn)
}

func inTx(ctx context.Context, op string, db TxBeginner, opts *sql.TxOptions, keys []pgcoord.Key, fn func(tx *sql.Tx) error) error {
	if isNil(db) {
		return errors.New("pgcoord: " + op + " " + impl.Subject(keys) + ": nil TxBeginner (*sql.DB or *sql.Conn)")
	}
	var run func(xactsql.Txn) error // nil for a nil fn, which impl.InTx reports
	if fn != nil {
		run = func(t xactsql.Txn) error { return fn(t.(sqlTx).tx) }
	}
	begin := func(ctx context.Context) (xactsql.Txn, error) {
		tx, err := db.BeginTx(ctx, opts)
		if err != nil {
			return nil, err
		}
		return sqlTx{tx}, nil
	}
	return impl.InTx(ctx, op, begin, keys, run)
}

// isNil reports whether db is nil, or holds a nil pointer (a nil *sql.DB or
// *sql.Conn, say), whose BeginTx would panic.
func isNil(db TxBeginner) bool {
	if db == nil {
		return true
	}
	v := reflect.ValueOf(db)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// sqlTx is a *sql.Tx as an xactsql.Txn.
type sqlTx struct{ tx *sql.Tx }

func (t sqlTx) Exec(ctx context.Context, query string, args ...any) error {
	_, err := t.tx.ExecContext(ctx, query, args...)
	return endedDuring(ctx, err)
}

func (t sqlTx) QueryRow(ctx context.Context, query string, args []any, dest ...any) error {
	err := t.tx.QueryRowContext(ctx, query, args...).Scan(dest...)
	if errors.Is(err, sql.ErrNoRows) {
		err = xactsql.ErrNoRows
	}
	if err == nil || err == xactsql.ErrNoRows {
		if cerr := endedDuring(ctx, nil); cerr != nil {
			return cerr
		}
	}
	return err
}

// endedDuring returns err, or, when the statement succeeded but ctx is done
// by the time it returned, an error wrapping ctx's. A driver may close the
// connection when ctx ends during a statement even though the statement
// succeeded: lib/pq does, once it has sent the server a cancel request that
// came too late, and the transaction (with its keys) ends with the backend.
// Nothing tells the caller which happened, so the statement's success cannot
// be trusted.
func endedDuring(ctx context.Context, err error) error {
	if err != nil {
		return err
	}
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (the statement completed, but ctx ended by then and the driver may be closing the connection, which ends the transaction)", cerr)
	}
	return nil
}

// Commit and Rollback: database/sql takes no context for them; the one given
// to BeginTx bounds them, where the driver uses it.
func (t sqlTx) Commit(context.Context) error   { return t.tx.Commit() }
func (t sqlTx) Rollback(context.Context) error { return t.tx.Rollback() }
