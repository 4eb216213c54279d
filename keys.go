package pgcoord

// Keys: the names of advisory locks

import (
	"unsafe"

	"github.com/pgcoord/pgcoord/internal/core"
)

// Key names an advisory lock. PostgreSQL has two key spaces that never
// overlap: a single bigint (built with [Int64Key] or [HashKey]) and a pair of
// int4 values (built with [PairKey]). A Key remembers which space it is in, so
// Int64Key(1<<32|2) and PairKey(1, 2) are different locks, exactly as they are
// in PostgreSQL.
//
// The zero Key is not a valid key: every function that takes a Key rejects it
// with [ErrInvalidKey], so a forgotten initialisation cannot silently collide
// with Int64Key(0).
type Key struct {
	kind uint8 // the key space, as the core's Key.Kind
	v    int64 // bigint value, or uint32(a)<<32 | uint32(b) for a pair
}

// coreKey returns k as the lock core takes it, and keyOf the core's key as
// the API gives it.
func (k Key) coreKey() core.Key { return core.KeyOf(k.kind, k.v) }

func keyOf(k core.Key) Key { return Key{k.Kind(), k.V} }

// HashKey derives a bigint key from one or more string parts, such as
// HashKey("invoice", id). The parts are encoded unambiguously before hashing,
// so ("ab", "c") and ("a", "bc") are different keys, and so are ("a") and
// ("a", "").
//
// The algorithm is frozen and documented in the README so other languages
// can compute the same key: xxhash64 (seed 0) over the bytes of
// "pgcoord.HashKey.v1" followed, for each part, by its length in bytes as an
// 8-byte big-endian unsigned integer and then its bytes; the 64-bit result
// is reinterpreted as a signed two's-complement bigint.
//
// HashKey with no parts returns the zero (invalid) Key, which every lock
// function rejects with [ErrInvalidKey]. Parts may hold any bytes, including
// NUL and invalid UTF-8; they are never sent to the server.
func HashKey(parts ...string) Key { return keyOf(core.HashKey(parts...)) }

// Int64Key returns the key that PostgreSQL's pg_advisory_lock(bigint) takes.
// Every int64, including 0 and negative values, is a valid key.
func Int64Key(k int64) Key { return keyOf(core.Int64Key(k)) }

// PairKey returns the key that PostgreSQL's pg_advisory_lock(int4, int4)
// takes. Pair keys never conflict with bigint keys.
func PairKey(a, b int32) Key { return keyOf(core.PairKey(a, b)) }

// IsZero reports whether k is the zero Key, which names no lock: a Key not
// built by [HashKey] (with at least one part), [Int64Key] or [PairKey].
// Every call given the zero Key returns an error wrapping [ErrInvalidKey].
func (k Key) IsZero() bool { return k.coreKey().IsZero() }

// Int64 returns the bigint value of a key from [Int64Key] or [HashKey]; ok is
// false for pair keys and the zero Key.
func (k Key) Int64() (v int64, ok bool) { return k.coreKey().Int64() }

// Pair returns the two halves of a key from [PairKey]; ok is false for bigint
// keys and the zero Key.
func (k Key) Pair() (a, b int32, ok bool) { return k.coreKey().Pair() }

// String formats k as ParseKey reads it: "int64:N" for bigint keys,
// "pair:A,B" for pair keys, and "invalid" for the zero Key.
func (k Key) String() string { return k.coreKey().String() }

// ParseKey reads a key in the form that [Key.String] writes: "int64:N" or
// "pair:A,B" (decimal, optionally signed). It returns an error wrapping
// [ErrInvalidKey] that names the problem for anything else.
func ParseKey(s string) (Key, error) {
	k, err := core.ParseKey(s)
	return keyOf(k), err
}

// KeyFromLock decodes the key of an advisory lock from the classid, objid
// and objsubid columns of a pg_locks row with locktype 'advisory'. objsubid
// is 1 for bigint keys, whose value is (classid << 32) | objid, and 2 for pair
// keys (classid, objid). Any other objsubid is an error wrapping
// [ErrInvalidKey].
func KeyFromLock(classid, objid uint32, objsubid int16) (Key, error) {
	k, err := core.KeyFromLock(classid, objid, objsubid)
	return keyOf(k), err
}

// MarshalText implements [encoding.TextMarshaler] with the form of
// [Key.String] ("int64:N" or "pair:A,B"), so a Key can be a field or a map
// key in JSON, YAML or TOML. The zero Key marshals to empty text, which
// UnmarshalText reads back as the zero Key (still rejected by every lock
// function). It never returns an error.
func (k Key) MarshalText() ([]byte, error) { return k.coreKey().MarshalText() }

// UnmarshalText implements [encoding.TextUnmarshaler]: it reads what
// [ParseKey] reads, and empty text as the zero Key. It returns an error
// wrapping [ErrInvalidKey] for anything else, and leaves k unchanged then.
func (k *Key) UnmarshalText(text []byte) error {
	if k == nil {
		return (*core.Key)(nil).UnmarshalText(text) // it fails before it writes, for text it cannot parse
	}
	c := k.coreKey()
	if err := c.UnmarshalText(text); err != nil {
		return err
	}
	*k = keyOf(c)
	return nil
}

// coreKeys returns keys as the lock core takes them, and keysOf the
// core's keys as the API gives them: the same memory seen as the other
// type, as a Key and the core's Key lay out the same two fields. The core
// copies what it keeps, as it did the caller's keys before; whoever gets a
// view of the core's keys must not change them.
func coreKeys(keys []Key) []core.Key {
	return unsafe.Slice((*core.Key)(unsafe.Pointer(unsafe.SliceData(keys))), len(keys))
}

func keysOf(keys []core.Key) []Key {
	return unsafe.Slice((*Key)(unsafe.Pointer(unsafe.SliceData(keys))), len(keys))
}
