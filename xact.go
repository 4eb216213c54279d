package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/jackc/pgx/v5"
	"github.com/pgcoord/pgcoord/internal/xactsql"
)

// Transaction-level locks
//
// XactLock, XactRLock, XactTryLock, XactTryRLock and InTx take PostgreSQL's
// transaction-level advisory locks (pg_advisory_xact_lock and friends). Such
// a lock belongs to the transaction, not to the connection: PostgreSQL
// releases it when the transaction ends, and there is no way to release it
// earlier. Nothing is left on the connection afterwards, whatever happened.
//
// All keys given to one call are validated, deduplicated and taken in the
// canonical order (the order LockAll uses), in one statement and one round
// trip: SELECT pg_advisory_xact_lock($1::int8), pg_advisory_xact_lock(...).
// PostgreSQL evaluates the select list of a single-row SELECT without FROM
// left to right, each call returning before the next starts, so the keys are
// taken one after the other in that order (TestXactLockOrder checks it in
// pg_locks). Two transactions that lock overlapping sets of keys, each in one
// call, cannot deadlock on those keys. Keys taken by separate calls in one
// transaction are ordered only within each call.
//
// When the keys are released, as PostgreSQL behaves (each point is checked
// by a test that reads pg_locks):
//
//   - COMMIT or ROLLBACK releases every key.
//   - A statement error (including a cancelled statement and a deadlock)
//     aborts the transaction at once, and PostgreSQL releases its locks, the
//     advisory ones included, at that moment, not at ROLLBACK. The
//     transaction block stays open in the failed state until ROLLBACK and
//     every further statement fails with SQLSTATE 25P02, but the keys protect
//     nothing any more: another transaction can take them right away. The
//     trap is work outside the database (a call to a payment provider, a file
//     write) done after an ignored error in the belief that the keys are
//     still held. An error inside a savepoint aborts only that subtransaction:
//     keys taken after the savepoint are released, keys taken before it stay
//     held. InTx rolls back as soon as fn returns an error or panics; if fn
//     ignores a statement error and returns nil, COMMIT turns into ROLLBACK
//     and InTx returns an error wrapping pgx.ErrTxCommitRollback. Nested in
//     a pgx.Tx, InTx then rolls back to its savepoint instead of sending
//     RELEASE SAVEPOINT, so the outer transaction is not left failed.
//   - ROLLBACK TO SAVEPOINT releases the keys taken after that savepoint,
//     while the transaction goes on (a subtransaction's locks go with it, as
//     row and table locks do). A key that was already held before the
//     savepoint stays held. RELEASE SAVEPOINT keeps the keys, now owned by
//     the enclosing transaction. pgx's nested transactions (Begin on a
//     pgx.Tx) are savepoints: XactLock on a nested transaction is undone by
//     its Rollback, and InTx given a pgx.Tx keeps its keys after returning
//     nil, until the outer transaction ends. Take keys before any savepoint
//     you may roll back to, or take them again after rolling back to it.
//
// Isolation level: the keys serialise what the holders do only if each
// holder's statements see what the previous holder committed, which is what
// READ COMMITTED gives (each statement takes a new snapshot). Under
// REPEATABLE READ and SERIALIZABLE the transaction's snapshot is taken by
// its first statement, and when the lock statement is that statement it is
// taken when the statement starts, before the key is granted: the holder
// does not see what the previous holder committed while it waited. Under
// REPEATABLE READ a read-then-write under the key then silently works on a
// stale read (two holders can both withdraw the same money); under
// SERIALIZABLE the server reports a serialization failure (SQLSTATE 40001)
// instead of a wrong result. Use READ COMMITTED for work that the keys must
// serialise. InTx begins its transaction with ISOLATION LEVEL READ COMMITTED,
// so that a database or role default (default_transaction_isolation) does
// not defeat the keys; so does InTxOptions when no isolation level is given.
// A transaction of your own that you pass to XactLock runs at whatever level
// it was begun with.
//
// Round trips and statements: each lock statement runs in
// pgx.QueryExecModeExec, whatever the connection's default query mode: one
// round trip, with the unnamed statement, nothing prepared on the server and
// nothing added to pgx's statement cache (the statement's text varies with
// the number of keys).
//
// Transaction pooling (PgBouncer pool_mode=transaction) hands each
// transaction to whatever server connection is free. The Xact functions use
// no session state: the lock and the statements that rely on it live in one
// transaction, on one server connection, and nothing outlives it. They work
// in every pgx query mode, including QueryExecModeExec and
// QueryExecModeSimpleProtocol, which need no named prepared statements (for
// PgBouncer before 1.21, or without max_prepared_statements).
//
// A wait that ends because ctx is done frees the transaction's keys,
// including those taken before the one waited on (inside a savepoint, under
// pgconn.CancelRequestContextWatcherHandler, only those taken after the
// savepoint: the cancelled statement aborts the subtransaction, as any
// statement error there does), because pgx sends
// PostgreSQL a cancel request (on a new connection): the statement fails,
// which aborts the transaction and releases its locks. Closing the
// connection would not be enough: a backend waiting on a lock does not look
// at its socket (unless client_connection_check_interval is set), so if the
// cancel request cannot reach the server the keys stay held until the wait
// ends by itself. The keys are free once the server has processed the
// cancel request: 12 to 35 ms after ctx ended when measured against a local
// server, though a heavily loaded 2-core machine stretched that to 1.6 s
// (the tests allow 5 s). How the call ends depends on pgx's context handler:
//
//   - pgx's default handler (a socket deadline) makes XactLock return as
//     soon as ctx is done, with the connection already marked closed, and
//     before the keys are released: pgx sends the cancel request, then
//     Terminate, in the background, and the backend exits. Rollback fails,
//     as the connection is closed; a pool discards it.
//   - pgconn.CancelRequestContextWatcherHandler, given a DeadlineDelay
//     longer than the server takes to answer, waits for the answer (SQLSTATE
//     57014): the keys are already free when XactLock returns, about
//     100 ms after their release (pgx pauses that long after a cancel
//     request). The connection stays open with the transaction in the
//     failed state; Rollback succeeds and the connection is usable again.
//     If DeadlineDelay passes first, the connection is closed as with the
//     default handler.
//
// The cancel request races with the wait: if the last key is granted just
// before it arrives, PostgreSQL ignores it. XactLock then returns nil with
// every key held under the cancel request handler; under the default handler
// it still returns the context's error, and the keys go when the backend
// exits. A ctx that is already done when a statement is about to be sent (at
// the call, or between the statements of a call with more than 1000 keys)
// sends nothing: the transaction is not aborted and keeps the keys it holds.
// TestXactCancelDefaultHandler, TestXactCancelRequestHandler,
// TestXactCancelRequestHandlerSavepoint, TestXactCancelBeforeSend and
// TestXactCancelNeedsCancelRequest check all of this in pg_locks.

// xactRollbackTimeout bounds the ROLLBACK that InTx sends after an error or a
// panic; it runs even when the caller's ctx is already done.
const xactRollbackTimeout = 10 * time.Second

// TxBeginner starts a transaction. *pgxpool.Pool, *pgx.Conn and pgx.Tx (whose
// Begin starts a nested transaction implemented with a savepoint) satisfy it.
type TxBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// xactMode selects the PostgreSQL function a call uses.
type xactMode struct {
	op  string // the operation, as errors name it ("xact lock")
	fn  string // PostgreSQL function
	try bool
}

var (
	modeXactLock     = xactMode{"xact lock", "pg_advisory_xact_lock", false}
	modeXactRLock    = xactMode{"xact read lock", "pg_advisory_xact_lock_shared", false}
	modeXactTryLock  = xactMode{"xact try lock", "pg_try_advisory_xact_lock", true}
	modeXactTryRLock = xactMode{"xact try read lock", "pg_try_advisory_xact_lock_shared", true}
)

// xactModes maps the modes that package pgcoordsql names to ours.
var xactModes = [...]xactMode{
	xactsql.Lock:     modeXactLock,
	xactsql.RLock:    modeXactRLock,
	xactsql.TryLock:  modeXactTryLock,
	xactsql.TryRLock: modeXactTryRLock,
}

// The code below runs on an xactsql.Tx, so that package pgcoordsql runs it
// on a *sql.Tx: hand it over.
func init() {
	xactsql.Registered = xactsql.Impl[Key, Term, FenceOption]{
		Acquire: func(ctx context.Context, op string, mode xactsql.Mode, tx xactsql.Tx, keys []Key) error {
			m := xactModes[mode]
			m.op = op
			return xactAcquire(ctx, m, tx, coreKeys(keys))
		},
		InTx: func(ctx context.Context, op string, begin func(context.Context) (xactsql.Txn, error), keys []Key, fn func(tx xactsql.Txn) error) error {
			return inTx(ctx, op, begin, coreKeys(keys), fn)
		},
		CheckFence: func(ctx context.Context, tx xactsql.Tx, key Key, fence Term, opts []FenceOption) error {
			c, err := newFenceConfig(opts)
			if err != nil {
				return core.Errorf("check fence %s: %w", core.KeyList([]core.Key{key.coreKey()}), err)
			}
			return checkFence(ctx, c, tx, key.coreKey(), fence)
		},
		Subject: func(keys []Key) string { return keysSubject(coreKeys(keys)) },
	}
}

// pgxTx is a pgx.Tx as an xactsql.Txn. nested marks a transaction that
// InTx began on a pgx.Tx: a savepoint, which its Commit treats apart.
type pgxTx struct {
	tx     pgx.Tx
	nested bool
}

func (t pgxTx) Exec(ctx context.Context, sql string, args ...any) error {
	_, err := t.tx.Exec(ctx, sql, args...)
	return err
}

func (t pgxTx) QueryRow(ctx context.Context, sql string, args []any, dest ...any) error {
	err := t.tx.QueryRow(ctx, sql, args...).Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return xactsql.ErrNoRows
	}
	return err
}

func (t pgxTx) Rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }

// Commit commits t. For a savepoint, it first makes sure that fn's work
// is not left in the outer transaction when it cannot be kept: pgx's Commit
// of a nested transaction sends RELEASE SAVEPOINT and marks the transaction
// closed even when that fails, rolling nothing back, so a failed release
// would leave the savepoint open, with fn's work and keys, in the outer
// transaction, and a subtransaction aborted by a statement error that fn
// ignored would poison the outer transaction. So:
//
//   - if the connection reports a failed transaction (a statement failed
//     in the savepoint and fn returned nil), it rolls back to the savepoint
//     and returns an error wrapping pgx.ErrTxCommitRollback;
//   - if ctx is done, it rolls back to the savepoint and returns an error
//     wrapping ctx's error;
//   - otherwise it releases the savepoint with a context that ctx's end does
//     not cut short (bounded by xactRollbackTimeout), so the release is not
//     skipped halfway: RELEASE SAVEPOINT waits for nothing.
//
// The rollback, too, runs with such a context.
func (t pgxTx) Commit(ctx context.Context) error {
	if !t.nested {
		return t.tx.Commit(ctx)
	}
	var why error
	if c := t.tx.Conn(); c != nil && c.PgConn().TxStatus() == 'E' {
		why = fmt.Errorf("a statement failed in the savepoint and fn returned nil: %w", pgx.ErrTxCommitRollback)
	} else if err := ctx.Err(); err != nil {
		why = fmt.Errorf("ctx ended before the savepoint was released: %w", err)
	}
	rctx, cancel := core.WithoutCancel(ctx, xactRollbackTimeout)
	defer cancel()
	if why == nil {
		if err := t.tx.Commit(rctx); err != nil {
			// pgx has marked the savepoint closed, and the connection is
			// closed or the outer transaction failed: either way it is over.
			return core.Errorf("releasing the savepoint failed (roll the outer transaction back): %w", err)
		}
		return nil
	}
	if err := t.tx.Rollback(rctx); err != nil {
		return core.Errorf("%w; rolling back to the savepoint failed too (roll the outer transaction back): %w", why, err)
	}
	return core.Errorf("%w; rolled back to the savepoint, the outer transaction goes on", why)
}

// pgxLockTx is a pgx.Tx that runs the lock statements in
// pgx.QueryExecModeExec, whatever the connection's default query mode: one
// round trip per statement, with nothing prepared on the server or kept in
// pgx's statement cache (the statement's text varies with the number of
// keys, so caching it would fill the cache with one-off texts). It uses only
// the unnamed statement, which PgBouncer's transaction pooling supports.
type pgxLockTx pgxTx

func (t pgxLockTx) Exec(ctx context.Context, sql string, args ...any) error {
	_, err := t.tx.Exec(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...)...)
	return err
}

func (t pgxLockTx) QueryRow(ctx context.Context, sql string, args []any, dest ...any) error {
	return pgxTx(t).QueryRow(ctx, sql, append([]any{pgx.QueryExecModeExec}, args...), dest...)
}

// lockTx returns tx as it should run the lock statements: a pgx.Tx in
// pgx.QueryExecModeExec (see pgxLockTx), any other tx as it is.
func lockTx(tx xactsql.Tx) xactsql.Tx {
	if p, ok := tx.(pgxTx); ok {
		return pgxLockTx(p)
	}
	return tx
}

// beginPgx begins a transaction with begin, as an xactsql.Txn; nested
// says that begin starts a savepoint (see pgxTx.Commit).
func beginPgx(begin func(context.Context) (pgx.Tx, error), nested bool) func(context.Context) (xactsql.Txn, error) {
	return func(ctx context.Context) (xactsql.Txn, error) {
		tx, err := begin(ctx)
		if err != nil {
			return nil, err
		}
		return pgxTx{tx: tx, nested: nested}, nil
	}
}

// withPgx calls fn with the pgx.Tx behind t, which beginPgx made.
func withPgx(fn func(pgx.Tx) error) func(xactsql.Txn) error {
	if fn == nil {
		return nil // inTx reports it
	}
	return func(t xactsql.Txn) error { return fn(t.(pgxTx).tx) }
}

// XactLock takes exclusive transaction-level advisory locks on keys in tx,
// waiting until every key is free. The keys are validated, deduplicated and
// taken in the canonical order in one statement, so concurrent callers that
// lock overlapping sets of keys, each set in one call, cannot deadlock on
// them. The locks are released when tx commits or rolls back, and cannot be
// released earlier.
// Only a pgx.Tx is accepted: outside a transaction block each statement is
// its own transaction, and the lock would be gone when XactLock returned.
//
// ctx governs the wait. If ctx ends during the wait, pgx sends the server a
// cancel request, which aborts tx and so releases all of its keys, including
// those taken before the one waited on, tens of milliseconds after ctx ended
// on a local server. With pgx's default context handler, XactLock returns at
// once, before the keys are released, and the connection is closed; with
// pgconn.CancelRequestContextWatcherHandler, the keys are free when XactLock
// returns (about 100 ms after ctx ended) and the connection is usable again
// after Rollback. After such an error tx cannot be used any more: roll it
// back. If the cancel request cannot reach the server, the keys stay held
// until the wait ends by itself: closing the connection does not end a lock
// wait. A ctx that is done before the statement is sent sends nothing and
// leaves tx and its keys as they were. Every error from the server aborts tx
// and releases its keys as well. A nil tx or an invalid key list is reported
// without touching tx.
//
// Traps: a statement error later in tx releases the keys at once, although
// tx stays open in the failed state until ROLLBACK, so nothing done after an
// ignored error is protected; ROLLBACK TO a savepoint taken before XactLock
// releases the keys while tx goes on. [InTx] rolls back on any error and
// refuses to commit after an ignored one. XactLock uses no session state and
// works behind PgBouncer's transaction pooling, in every pgx query mode; its
// statement runs in pgx.QueryExecModeExec (one round trip, nothing
// prepared).
//
// Isolation: if tx is REPEATABLE READ or SERIALIZABLE, its snapshot was
// taken by its first statement, at the latest when the lock statement
// started, before the keys were granted, so tx does not see what the
// previous holder committed: under REPEATABLE READ a read-then-write under
// the keys works on a stale read without any error, under SERIALIZABLE the
// server reports SQLSTATE 40001 instead. Begin tx READ COMMITTED when the keys must
// serialise read-then-write work (see the package documentation).
//
// XactLock returns an error wrapping [ErrInvalidKey] for an empty or invalid
// key list (before sending anything), [ErrDeadlock] if PostgreSQL chose tx as
// a deadlock victim (possible only with keys taken by other calls or with
// other locks, such as row locks), [ErrTooManyLocks] if the server's lock
// table is full, and the context's error when ctx ended the wait; other
// errors are pgx's, wrapped. A nil tx, or a nil pointer in it (a nil
// *pgxpool.Tx), is an error, and so is a nil ctx; neither panics. Every
// error reads "pgcoord: xact lock <keys>: <cause>" (xact read lock, xact try
// lock, xact try read lock for the siblings), the keys in canonical order.
func XactLock(ctx context.Context, tx pgx.Tx, keys ...Key) error {
	return xactAcquirePgx(ctx, modeXactLock, tx, coreKeys(keys))
}

// XactRLock is [XactLock] for shared locks: any number of transactions can
// hold a key shared at once, and they exclude exclusive holders. PostgreSQL
// queues a new shared request behind a waiting exclusive one, so writers are
// not starved. Everything XactLock says about order, ctx, release and errors
// applies.
func XactRLock(ctx context.Context, tx pgx.Tx, keys ...Key) error {
	return xactAcquirePgx(ctx, modeXactRLock, tx, coreKeys(keys))
}

// XactTryLock is [XactLock] without waiting: it tries the keys in canonical
// order, in one statement, and stops at the first key held by another
// transaction, returning an error wrapping [ErrLocked] that names it.
//
// Partial success: transaction-level locks cannot be released before the
// transaction ends, and a failed try is not an error to PostgreSQL, so tx is
// not aborted. When XactTryLock returns ErrLocked, the keys before the held
// one in canonical order stay locked by tx until it ends; the held key and
// the keys after it were not taken. The caller should roll tx back (which
// releases those keys) and retry later, rather than go on holding a subset.
//
// ctx bounds the statement. Other errors are those of XactLock, and abort tx
// as they do there.
func XactTryLock(ctx context.Context, tx pgx.Tx, keys ...Key) error {
	return xactAcquirePgx(ctx, modeXactTryLock, tx, coreKeys(keys))
}

// XactTryRLock is [XactTryLock] for shared locks: it fails with an error
// wrapping [ErrLocked] only when another transaction holds a key exclusively
// or is waiting to (PostgreSQL does not let a new shared holder overtake a
// waiting exclusive request). What XactTryLock says about partial success
// applies.
func XactTryRLock(ctx context.Context, tx pgx.Tx, keys ...Key) error {
	return xactAcquirePgx(ctx, modeXactTryRLock, tx, coreKeys(keys))
}

// InTx begins a transaction on db, takes exclusive transaction-level locks on
// keys in canonical order (as [XactLock] does), calls fn, and commits. If the
// lock, fn or the commit fails, or fn panics, the transaction is rolled back
// and every key is released; a panic is re-raised after the rollback. It
// makes no round trips beyond BEGIN, one lock statement (one per 1000 keys
// for more; run in pgx.QueryExecModeExec, so nothing is prepared first,
// whatever the connection's default query mode), fn's own and COMMIT. Like
// pgx.BeginFunc, but with the keys held for exactly the life of the
// transaction.
//
// An empty keys (nil or of length 0) takes no lock: InTx then begins, calls
// fn and commits with the same rollback, isolation and savepoint handling,
// for a transaction that needs no key of its own, such as one that writes
// only after [CheckFence] of a fence held elsewhere.
//
// When db can begin a transaction with options (it has BeginTx, as
// *pgxpool.Pool and *pgx.Conn do), InTx begins it with ISOLATION LEVEL READ
// COMMITTED, whatever the database's or role's default_transaction_isolation:
// under REPEATABLE READ or SERIALIZABLE the snapshot would be taken before
// the keys are granted, and fn would not see what the previous holder
// committed (see [InTxOptions]). Any other TxBeginner's Begin is used as it
// is.
//
// ctx governs BEGIN, the wait for the keys and COMMIT; fn should use the ctx
// it captures for its own statements. The rollback after a failure uses a
// context that is not cancelled with ctx, bounded by a timeout, so a
// cancelled ctx still ends the transaction on the server.
//
// fn should return a statement's error rather than ignore it: the error has
// already aborted the transaction and released the keys (see XactLock), so
// whatever fn does after it is not protected. If fn returns nil anyway,
// COMMIT turns into ROLLBACK and InTx returns an error wrapping
// pgx.ErrTxCommitRollback.
//
// When db is itself a pgx.Tx, InTx runs in a nested transaction (a
// savepoint) at the outer transaction's isolation level: on success the
// savepoint is released and the keys stay held until the outer transaction
// ends; on failure ROLLBACK TO SAVEPOINT releases them while the outer
// transaction goes on. That holds for every failure after the savepoint:
// the lock, fn's error or panic, a statement error that fn ignored before
// returning nil (the error then wraps pgx.ErrTxCommitRollback and says so),
// and ctx ending after fn returned nil (the error then wraps ctx's and says
// that the savepoint was not released). InTx checks those two before it
// sends RELEASE SAVEPOINT, and sends it and any ROLLBACK TO SAVEPOINT with a
// context that ctx's end does not cut short, bounded by a timeout: neither
// waits for anything. So when a nested InTx returns an error, the outer
// transaction holds exactly what it held before the call (its keys, its
// work) and nothing of fn's, and it can go on and commit; only if the
// rollback itself fails (a broken connection), which the error then says,
// must the outer transaction be rolled back. When it returns nil, the outer
// transaction holds fn's work and the keys.
// TestInTxNestedFailureRollsBackSavepoint checks this in pg_locks and in
// the table the outer transaction commits.
//
// fn must not commit or roll back the transaction it is given: InTx ends
// it. A transaction that fn ended leaves InTx nothing to roll back, and for
// a savepoint, fn's work and keys stay in the outer transaction.
//
// fn's error is returned unchanged, except for a savepoint whose rollback
// failed, where the error says so and asks to roll the outer transaction
// back (a failed rollback of a transaction of its own closes the
// connection, which ends the transaction on the server). Other errors: those of XactLock ([ErrInvalidKey], checked before
// BEGIN; [ErrDeadlock]; [ErrTooManyLocks]; the context's error), and BEGIN or
// COMMIT errors from pgx, wrapped. A nil ctx, db or fn is an error (none of
// them panics), and so is a nil pointer in db (a nil *pgxpool.Pool,
// *pgx.Conn or *pgxpool.Tx). InTx's own errors read "pgcoord: in tx
// <keys>: <cause>" ("in tx []" for no keys).
//
// InTx works behind PgBouncer's transaction pooling, since it uses no session
// state.
func InTx(ctx context.Context, db TxBeginner, keys []Key, fn func(tx pgx.Tx) error) error {
	if isNil(db) {
		return core.Errorf("in tx %s: nil TxBeginner", keysSubject(coreKeys(keys)))
	}
	if _, nested := db.(pgx.Tx); nested {
		return inTx(ctx, "in tx", beginPgx(db.Begin, true), coreKeys(keys), withPgx(fn))
	}
	begin := db.Begin
	if b, ok := db.(TxOptionsBeginner); ok {
		begin = func(ctx context.Context) (pgx.Tx, error) {
			return b.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		}
	}
	return inTx(ctx, "in tx", beginPgx(begin, false), coreKeys(keys), withPgx(fn))
}

// TxOptionsBeginner starts a transaction with options. *pgxpool.Pool and
// *pgx.Conn satisfy it; a pgx.Tx does not, since a nested transaction (a
// savepoint) has no options of its own.
type TxOptionsBeginner interface {
	BeginTx(ctx context.Context, txOptions pgx.TxOptions) (pgx.Tx, error)
}

// InTxOptions is [InTx] with a transaction begun with txOptions (isolation
// level, access mode, deferrable), as pgx.BeginTxFunc is pgx.BeginFunc with
// options. Everything InTx says about keys, ctx, rollback and errors
// applies. A read-only transaction can take the locks: advisory locks are
// not writes. An unset txOptions.IsoLevel ("") means READ COMMITTED, as in
// InTx, not the database's default (unless txOptions.BeginQuery is set:
// pgx then sends it as it is).
//
// An explicit pgx.RepeatableRead or pgx.Serializable is honoured, but the
// keys then do not serialise read-then-write work: the transaction's
// snapshot is taken when the lock statement starts, before the keys are
// granted, so fn does not see what the previous holder committed. Under
// REPEATABLE READ fn silently reads stale data (two holders can both
// withdraw the same money); under SERIALIZABLE the server reports a
// serialization failure (SQLSTATE 40001) from fn or COMMIT instead of a
// wrong result, which rolls back and releases the keys like any other
// error; InTxOptions does not retry. Use READ COMMITTED unless fn needs
// REPEATABLE READ or SERIALIZABLE for reasons of its own.
//
// A nil db, or a nil *pgxpool.Pool or *pgx.Conn in it, is an error.
//
// It is a separate function rather than an option of InTx because only a
// database or connection can begin a transaction with options: InTx also
// accepts a pgx.Tx, and a variadic option would then have to fail at run
// time instead of at compile time.
func InTxOptions(ctx context.Context, db TxOptionsBeginner, txOptions pgx.TxOptions, keys []Key, fn func(tx pgx.Tx) error) error {
	if isNil(db) {
		return core.Errorf("in tx %s: nil TxOptionsBeginner", keysSubject(coreKeys(keys)))
	}
	if txOptions.IsoLevel == "" {
		txOptions.IsoLevel = pgx.ReadCommitted
	}
	begin := func(ctx context.Context) (pgx.Tx, error) { return db.BeginTx(ctx, txOptions) }
	return inTx(ctx, "in tx", beginPgx(begin, false), coreKeys(keys), withPgx(fn))
}

// inTx runs InTx and InTxOptions, and those of package pgcoordsql; op is
// the operation that errors name ("in tx"). An empty keys takes no lock.
func inTx(ctx context.Context, op string, begin func(context.Context) (xactsql.Txn, error), keys []core.Key, fn func(tx xactsql.Txn) error) error {
	mode := modeXactLock
	mode.op = op
	op += " " + keysSubject(keys) // with its subject, as errors name it
	if ctx == nil {
		return core.Errorf("%s: ctx is nil", op)
	}
	if fn == nil {
		return core.Errorf("%s: fn is nil", op)
	}
	var ks []core.Key
	if len(keys) > 0 {
		var err error
		if ks, err = core.CanonicalKeys(keys); err != nil {
			return core.Errorf("%s: %w", op, err)
		}
	}

	tx, err := begin(ctx)
	if err != nil {
		return core.Errorf("%s: begin: %w", op, core.WithCtxErr(ctx, err))
	}
	// Runs with done still false only if fn panicked or called
	// runtime.Goexit: roll back, and let the panic go on.
	done := false
	defer func() {
		if !done {
			rollbackTxn(ctx, tx)
		}
	}()

	if err := xactExec(ctx, mode, tx, ks); err != nil {
		done = true
		return rolledBack(ctx, op, tx, err)
	}
	if err := fn(tx); err != nil {
		done = true
		return rolledBack(ctx, op, tx, err)
	}
	done = true
	if err := tx.Commit(ctx); err != nil {
		return xactError(ctx, op+": commit", err)
	}
	return nil
}

// rollbackTx rolls tx back with a context that ctx's cancellation does not
// reach, bounded by xactRollbackTimeout. The error is dropped: pgx closes
// the connection when a rollback fails, which ends the transaction on the
// server.
func rollbackTx(ctx context.Context, tx pgx.Tx) { _ = rollbackTxn(ctx, pgxTx{tx: tx}) }

// rollbackTxn is rollbackTx for any transaction InTx begins, and returns
// the rollback's error. database/sql discards a connection whose rollback
// failed, as pgx closes it.
func rollbackTxn(ctx context.Context, tx xactsql.Txn) error {
	ctx, cancel := core.WithoutCancel(ctx, xactRollbackTimeout)
	defer cancel()
	return tx.Rollback(ctx)
}

// rolledBack rolls tx back after err and returns err. For a savepoint
// whose rollback failed (the connection broke), the outer transaction is
// over too, and the error says so: ROLLBACK TO SAVEPOINT could not release
// the savepoint's keys, and only the outer transaction's end does. op
// (with its subject) names the call in front of an error of fn's own.
func rolledBack(ctx context.Context, op string, tx xactsql.Txn, err error) error {
	rerr := rollbackTxn(ctx, tx)
	if t, ok := tx.(pgxTx); ok && t.nested && rerr != nil {
		if strings.HasPrefix(err.Error(), core.Prefix) {
			return core.Errorf("%w; rolling back to the savepoint failed too (roll the outer transaction back): %w", err, rerr)
		}
		return core.Errorf("%s: %w; rolling back to the savepoint failed too (roll the outer transaction back): %w", op, err, rerr)
	}
	return err
}

// isNil reports whether v is nil or holds a nil pointer, such as a nil
// *pgxpool.Pool, *pgx.Conn or *pgxpool.Tx, whose methods would panic.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	return rv.Kind() == reflect.Pointer && rv.IsNil()
}

// keysSubject names keys as errors do: the canonical keys as keyList
// writes them, or keys as given when they are not a valid key list.
func keysSubject(keys []core.Key) string {
	if ks, err := core.CanonicalKeys(keys); err == nil {
		return core.KeyList(ks)
	}
	return core.KeyList(keys)
}

// xactAcquirePgx validates tx and keys and runs the lock statement.
func xactAcquirePgx(ctx context.Context, mode xactMode, tx pgx.Tx, keys []core.Key) error {
	if isNil(tx) {
		return core.Errorf("%s %s: nil pgx.Tx; begin a transaction first, or use InTx", mode.op, keysSubject(keys))
	}
	return xactAcquire(ctx, mode, pgxTx{tx: tx}, keys)
}

// xactAcquire validates ctx and keys and runs the lock statement on tx.
func xactAcquire(ctx context.Context, mode xactMode, tx xactsql.Tx, keys []core.Key) error {
	if ctx == nil {
		return core.Errorf("%s %s: ctx is nil", mode.op, keysSubject(keys))
	}
	ks, err := core.CanonicalKeys(keys)
	if err != nil {
		return core.Errorf("%s %s: %w", mode.op, core.KeyList(keys), err)
	}
	return xactExec(ctx, mode, tx, ks)
}

// xactExec takes the canonical keys ks in tx, in order: one statement for
// up to maxKeysPerStatement keys, one round trip per chunk beyond that.
// Errors name mode.op and ks.
func xactExec(ctx context.Context, mode xactMode, tx xactsql.Tx, ks []core.Key) error {
	op := mode.op + " " + core.KeyList(ks)
	tx = lockTx(tx)
	for i, chunk := range core.Chunked(ks) {
		if !mode.try {
			sql, args := core.LockSQL(mode.fn, chunk)
			if err := tx.Exec(ctx, sql, args...); err != nil {
				return xactError(ctx, op, err)
			}
			continue
		}
		sql, args := xactTryStatement(mode.fn, chunk)
		var failed int
		if err := tx.QueryRow(ctx, sql, args, &failed); err != nil {
			return xactError(ctx, op, err)
		}
		if failed == 0 {
			continue
		}
		pos := i*core.MaxKeysPerStatement + failed - 1 // in ks
		switch {
		case pos > 0:
			return core.Errorf("%s: %w: %v (the %d key(s) before it in canonical order stay locked by this transaction until it ends; roll back to release them)",
				op, ErrLocked, ks[pos], pos)
		case len(ks) > 1:
			return core.Errorf("%s: %w: %v", op, ErrLocked, ks[pos])
		}
		return core.Errorf("%s: %w", op, ErrLocked)
	}
	return nil
}

// xactTryStatement builds the statement that tries ks in order (see
// tryCase): it returns the 1-based position of the first key it could not
// take, or 0 if it took them all.
//
// Blocking modes use lockSQL: one call per key in the select list, which
// PostgreSQL evaluates left to right.
func xactTryStatement(fn string, ks []core.Key) (string, []any) {
	var b strings.Builder
	args := core.TryCase(&b, fn, ks, make([]any, 0, 2*len(ks)))
	return b.String(), args
}

// xactError maps err, a statement's error, through pgError, naming op (the
// operation and its subject); when ctx is done, the context's cause comes
// first (see withCtxErr).
func xactError(ctx context.Context, op string, err error) error {
	return core.PgError(op, core.WithCtxErr(ctx, err))
}
