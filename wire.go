package pgcoord

import (
	"context"
	"encoding/binary"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The statements of one key (a try, a wait, an unlock: the common path of
// every lock) take arguments of three kinds and answer booleans. queryRow
// runs them on pgconn directly, without pgx's rows: the statement is
// prepared under its own text once per connection (as pgx's QueryRow does
// for a named statement), the arguments are written straight in the
// protocol's binary form into a buffer of the session, and the row is read
// from pgconn's own buffers. That costs a few allocations where pgx's rows
// cost a few dozen, which matters on a contended path, where the client's
// work between a grant and the next unlock is part of everyone's wait.

// wireMaxArgs is the most arguments a statement of one key takes: a pair
// key's two halves, the backend's pid, and a lock_timeout.
const wireMaxArgs = 4

// wireBuf is a session's buffer for queryRow; statements on a session run
// one at a time, under its use token.
type wireBuf struct {
	bytes   [wireMaxArgs * 8]byte
	params  [wireMaxArgs][]byte
	formats [wireMaxArgs]int16
}

// binaryResults asks for every result column in binary form.
var binaryResults = []int16{pgx.BinaryFormatCode}

// queryRow is conn.QueryRow(ctx, sql, args...).Scan(dest...) for a
// statement of one key, whose arguments are int64, int32 or string and
// whose scanned columns are booleans; a nil dest skips its column. It
// returns pgx.ErrNoRows if the statement returned no row. The caller holds
// the session's connection. A connection with a pgx tracer goes through
// pgx, so that the tracer sees every statement, as does anything else
// queryRow does not encode.
func (s *Session) queryRow(ctx context.Context, conn *pgx.Conn, sql string, args []any, dest ...*bool) error {
	if len(args) > wireMaxArgs || s.traced {
		return pgxRow(ctx, conn, sql, args, dest)
	}
	sd, err := conn.Prepare(ctx, sql, sql)
	if err != nil {
		return err
	}
	params, formats, ok := s.wire.encode(sd, args)
	if !ok || len(sd.Fields) < len(dest) {
		return pgxRow(ctx, conn, sql, args, dest)
	}
	for i, d := range dest {
		if d != nil && sd.Fields[i].DataTypeOID != pgtype.BoolOID {
			return pgxRow(ctx, conn, sql, args, dest)
		}
	}
	rr := conn.PgConn().ExecPrepared(ctx, sd.Name, params, formats, binaryResults)
	rows := 0
	var scanErr error
	for rr.NextRow() {
		if rows++; rows > 1 {
			continue
		}
		values := rr.Values()
		for i, d := range dest {
			switch v := values[i]; {
			case d == nil:
			case len(v) == 1:
				*d = v[0] != 0
			case v == nil:
				scanErr = errorf("column %d of %q is NULL, want a boolean", i+1, sql)
			default:
				scanErr = errorf("column %d of %q: %d bytes for a boolean", i+1, sql, len(v))
			}
		}
	}
	if _, err := rr.Close(); err != nil {
		return err
	}
	switch {
	case scanErr != nil:
		return scanErr
	case rows == 0:
		return pgx.ErrNoRows
	}
	return nil
}

// encode writes args in the binary form of sd's parameter types (text
// parameters as text) into w, and reports false for an argument whose type
// it does not write.
func (w *wireBuf) encode(sd *pgconn.StatementDescription, args []any) ([][]byte, []int16, bool) {
	if len(sd.ParamOIDs) != len(args) {
		return nil, nil, false
	}
	buf := w.bytes[:0]
	var ends [wireMaxArgs]int
	for i, a := range args {
		switch v := a.(type) {
		case int64:
			if sd.ParamOIDs[i] != pgtype.Int8OID {
				return nil, nil, false
			}
			buf = binary.BigEndian.AppendUint64(buf, uint64(v))
			w.formats[i] = pgx.BinaryFormatCode
		case int32:
			if sd.ParamOIDs[i] != pgtype.Int4OID {
				return nil, nil, false
			}
			buf = binary.BigEndian.AppendUint32(buf, uint32(v))
			w.formats[i] = pgx.BinaryFormatCode
		case string:
			if sd.ParamOIDs[i] != pgtype.TextOID {
				return nil, nil, false
			}
			buf = append(buf, v...)
			w.formats[i] = pgx.TextFormatCode
		default:
			return nil, nil, false
		}
		ends[i] = len(buf)
	}
	start := 0
	for i := range args {
		w.params[i] = buf[start:ends[i]:ends[i]]
		start = ends[i]
	}
	return w.params[:len(args)], w.formats[:len(args)], true
}

// pgxRow is queryRow through pgx.
func pgxRow(ctx context.Context, conn *pgx.Conn, sql string, args []any, dest []*bool) error {
	rows, err := conn.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	scan := make([]any, max(len(rows.FieldDescriptions()), len(dest)))
	for i, d := range dest {
		if d != nil {
			scan[i] = d
		}
	}
	if err := rows.Scan(scan...); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}
