package pgcoord

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"
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
	kind keyKind
	v    int64 // bigint value, or uint32(a)<<32 | uint32(b) for a pair
}

type keyKind uint8

const (
	kindInvalid keyKind = iota
	kindInt64
	kindPair
)

// hashDomain is the fixed prefix of HashKey's input. Changing it, or anything
// else about the encoding, changes every key ever derived: it is frozen.
const hashDomain = "pgcoord.HashKey.v1"

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
func HashKey(parts ...string) Key {
	if len(parts) == 0 {
		return Key{}
	}
	return Key{kind: kindInt64, v: int64(xxhash.Sum64(hashInput(parts)))}
}

// hashInput is the byte string HashKey hashes: the domain, then each part
// as an 8-byte big-endian length and its bytes. It is injective: the
// lengths say where every part ends.
func hashInput(parts []string) []byte {
	n := len(hashDomain)
	for _, p := range parts {
		n += 8 + len(p)
	}
	b := make([]byte, 0, n)
	b = append(b, hashDomain...)
	for _, p := range parts {
		b = binary.BigEndian.AppendUint64(b, uint64(len(p)))
		b = append(b, p...)
	}
	return b
}

// Int64Key returns the key that PostgreSQL's pg_advisory_lock(bigint) takes.
// Every int64, including 0 and negative values, is a valid key.
func Int64Key(k int64) Key { return Key{kind: kindInt64, v: k} }

// PairKey returns the key that PostgreSQL's pg_advisory_lock(int4, int4)
// takes. Pair keys never conflict with bigint keys.
func PairKey(a, b int32) Key {
	return Key{kind: kindPair, v: int64(uint64(uint32(a))<<32 | uint64(uint32(b)))}
}

// IsZero reports whether k is the zero Key, which names no lock: a Key not
// built by [HashKey] (with at least one part), [Int64Key] or [PairKey].
// Every call given the zero Key returns an error wrapping [ErrInvalidKey].
func (k Key) IsZero() bool { return k.kind != kindInt64 && k.kind != kindPair }

// Int64 returns the bigint value of a key from [Int64Key] or [HashKey]; ok is
// false for pair keys and the zero Key.
func (k Key) Int64() (v int64, ok bool) { return k.v, k.kind == kindInt64 }

// Pair returns the two halves of a key from [PairKey]; ok is false for bigint
// keys and the zero Key.
func (k Key) Pair() (a, b int32, ok bool) {
	return int32(uint64(k.v) >> 32), int32(uint32(k.v)), k.kind == kindPair
}

// String formats k as ParseKey reads it: "int64:N" for bigint keys,
// "pair:A,B" for pair keys, and "invalid" for the zero Key.
func (k Key) String() string {
	switch k.kind {
	case kindInt64:
		return "int64:" + strconv.FormatInt(k.v, 10)
	case kindPair:
		a, b, _ := k.Pair()
		return "pair:" + strconv.FormatInt(int64(a), 10) + "," + strconv.FormatInt(int64(b), 10)
	}
	return "invalid"
}

// ParseKey reads a key in the form that [Key.String] writes: "int64:N" or
// "pair:A,B" (decimal, optionally signed). It returns an error wrapping
// [ErrInvalidKey] that names the problem for anything else.
func ParseKey(s string) (Key, error) {
	bad := func(why string) (Key, error) {
		return Key{}, errorf("%w: %q: %s (want \"int64:N\" or \"pair:A,B\")", ErrInvalidKey, s, why)
	}
	kind, rest, ok := strings.Cut(s, ":")
	if !ok {
		return bad("missing \"int64:\" or \"pair:\" prefix")
	}
	switch kind {
	case "int64":
		v, err := strconv.ParseInt(rest, 10, 64)
		if err != nil {
			return bad("not a 64-bit integer")
		}
		return Int64Key(v), nil
	case "pair":
		as, bs, ok := strings.Cut(rest, ",")
		if !ok {
			return bad("a pair needs two numbers separated by a comma")
		}
		a, err1 := strconv.ParseInt(as, 10, 32)
		b, err2 := strconv.ParseInt(bs, 10, 32)
		if err1 != nil || err2 != nil {
			return bad("pair halves must be 32-bit integers")
		}
		return PairKey(int32(a), int32(b)), nil
	}
	return bad("unknown key kind " + strconv.Quote(kind))
}

// KeyFromLock decodes the key of an advisory lock from the classid, objid
// and objsubid columns of a pg_locks row with locktype 'advisory'. objsubid
// is 1 for bigint keys, whose value is (classid << 32) | objid, and 2 for pair
// keys (classid, objid). Any other objsubid is an error wrapping
// [ErrInvalidKey].
func KeyFromLock(classid, objid uint32, objsubid int16) (Key, error) {
	v := int64(uint64(classid)<<32 | uint64(objid))
	switch objsubid {
	case 1:
		return Key{kind: kindInt64, v: v}, nil
	case 2:
		return Key{kind: kindPair, v: v}, nil
	}
	return Key{}, errorf("%w: pg_locks objsubid %d is not an advisory lock key space (want 1 or 2)", ErrInvalidKey, objsubid)
}

// lockColumns returns the classid, objid and objsubid that k has in pg_locks.
func (k Key) lockColumns() (classid, objid uint32, objsubid int16) {
	objsubid = 1
	if k.kind == kindPair {
		objsubid = 2
	}
	return uint32(uint64(k.v) >> 32), uint32(k.v), objsubid
}

// check returns an error wrapping ErrInvalidKey for the zero Key.
func (k Key) check() error {
	if k.IsZero() {
		return errorf("%w: the zero Key (or HashKey with no parts); build keys with HashKey, Int64Key or PairKey", ErrInvalidKey)
	}
	return nil
}

// compareKeys is the canonical order of keys: all bigint keys by value, then
// all pair keys by (a, b). Every multi-key function takes keys in this order,
// so two callers locking overlapping sets can never deadlock each other.
func compareKeys(x, y Key) int {
	if c := cmp.Compare(x.kind, y.kind); c != 0 {
		return c
	}
	if x.kind == kindPair {
		xa, xb, _ := x.Pair()
		ya, yb, _ := y.Pair()
		if c := cmp.Compare(xa, ya); c != 0 {
			return c
		}
		return cmp.Compare(xb, yb)
	}
	return cmp.Compare(x.v, y.v)
}

// canonicalKeys validates keys and returns a sorted, deduplicated copy. It
// returns an error wrapping ErrInvalidKey if keys is empty or holds an
// invalid key.
func canonicalKeys(keys []Key) ([]Key, error) {
	switch len(keys) {
	case 0:
		return nil, errorf("%w: no keys given", ErrInvalidKey)
	case 1:
		if err := keys[0].check(); err != nil {
			return nil, err
		}
		return []Key{keys[0]}, nil
	}
	for i, k := range keys {
		if err := k.check(); err != nil {
			return nil, errorf("key %d of %d: %w", i+1, len(keys), err)
		}
	}
	out := slices.Clone(keys)
	slices.SortFunc(out, compareKeys)
	return slices.Compact(out), nil
}

// MarshalText implements [encoding.TextMarshaler] with the form of
// [Key.String] ("int64:N" or "pair:A,B"), so a Key can be a field or a map
// key in JSON, YAML or TOML. The zero Key marshals to empty text, which
// UnmarshalText reads back as the zero Key (still rejected by every lock
// function). It never returns an error.
func (k Key) MarshalText() ([]byte, error) {
	if k.IsZero() {
		return []byte{}, nil
	}
	return []byte(k.String()), nil
}

// UnmarshalText implements [encoding.TextUnmarshaler]: it reads what
// [ParseKey] reads, and empty text as the zero Key. It returns an error
// wrapping [ErrInvalidKey] for anything else, and leaves k unchanged then.
func (k *Key) UnmarshalText(text []byte) error {
	if len(text) == 0 {
		*k = Key{}
		return nil
	}
	v, err := ParseKey(string(text))
	if err != nil {
		return err
	}
	*k = v
	return nil
}

// keyList names keys as errors and logs do: one key by its String, more in
// brackets, the first few of a long list and how many more there are.
func keyList(keys []Key) string {
	name := func(k Key) string {
		if k.check() != nil {
			return "Key{}" // the zero Key, whose String is "invalid"
		}
		return k.String()
	}
	if len(keys) == 1 {
		return name(keys[0])
	}
	const shown = 4
	s := make([]string, 0, shown+1)
	for _, k := range keys[:min(len(keys), shown)] {
		s = append(s, name(k))
	}
	if len(keys) > shown {
		s = append(s, fmt.Sprintf("and %d more", len(keys)-shown))
	}
	return "[" + strings.Join(s, " ") + "]"
}
