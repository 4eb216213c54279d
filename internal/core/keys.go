package core

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"
)

// Keys: PostgreSQL's two key spaces, their text and pg_locks forms, and
// the canonical order

// Key is the core of [pgcoord.Key], which documents it.
type Key struct {
	kind keyKind
	V    int64 // bigint value, or uint32(a)<<32 | uint32(b) for a pair
}

// KeyOf returns the key of kind and v, as Kind and V give them.
func KeyOf(kind uint8, v int64) Key { return Key{kind: keyKind(kind), V: v} }

// Kind returns k's key space: 0 for the zero Key.
func (k Key) Kind() uint8 { return uint8(k.kind) }

type keyKind uint8

const (
	kindInvalid keyKind = iota
	kindInt64
	kindPair
)

// hashDomain is the fixed prefix of HashKey's input. Changing it, or anything
// else about the encoding, changes every key ever derived: it is frozen.
const HashDomain = "pgcoord.HashKey.v1"

// HashKey is the core of [pgcoord.HashKey], which documents it.
func HashKey(parts ...string) Key {
	if len(parts) == 0 {
		return Key{}
	}
	return Key{kind: kindInt64, V: int64(xxhash.Sum64(HashInput(parts)))}
}

// HashInput is the byte string HashKey hashes: the domain, then each part
// as an 8-byte big-endian length and its bytes. It is injective: the
// lengths say where every part ends.
func HashInput(parts []string) []byte {
	n := len(HashDomain)
	for _, p := range parts {
		n += 8 + len(p)
	}
	b := make([]byte, 0, n)
	b = append(b, HashDomain...)
	for _, p := range parts {
		b = binary.BigEndian.AppendUint64(b, uint64(len(p)))
		b = append(b, p...)
	}
	return b
}

// Int64Key is the core of [pgcoord.Int64Key], which documents it.
func Int64Key(k int64) Key { return Key{kind: kindInt64, V: k} }

// PairKey is the core of [pgcoord.PairKey], which documents it.
func PairKey(a, b int32) Key {
	return Key{kind: kindPair, V: int64(uint64(uint32(a))<<32 | uint64(uint32(b)))}
}

// IsZero is the core of [pgcoord.Key.IsZero], which documents it.
func (k Key) IsZero() bool { return k.kind != kindInt64 && k.kind != kindPair }

// Int64 is the core of [pgcoord.Key.Int64], which documents it.
func (k Key) Int64() (v int64, ok bool) { return k.V, k.kind == kindInt64 }

// Pair is the core of [pgcoord.Key.Pair], which documents it.
func (k Key) Pair() (a, b int32, ok bool) {
	return int32(uint64(k.V) >> 32), int32(uint32(k.V)), k.kind == kindPair
}

// String is the core of [pgcoord.Key.String], which documents it.
func (k Key) String() string {
	switch k.kind {
	case kindInt64:
		return "int64:" + strconv.FormatInt(k.V, 10)
	case kindPair:
		a, b, _ := k.Pair()
		return "pair:" + strconv.FormatInt(int64(a), 10) + "," + strconv.FormatInt(int64(b), 10)
	}
	return "invalid"
}

// ParseKey is the core of [pgcoord.ParseKey], which documents it.
func ParseKey(s string) (Key, error) {
	bad := func(why string) (Key, error) {
		return Key{}, Errorf("%w: %q: %s (want \"int64:N\" or \"pair:A,B\")", ErrInvalidKey, s, why)
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

// KeyFromLock is the core of [pgcoord.KeyFromLock], which documents it.
func KeyFromLock(classid, objid uint32, objsubid int16) (Key, error) {
	v := int64(uint64(classid)<<32 | uint64(objid))
	switch objsubid {
	case 1:
		return Key{kind: kindInt64, V: v}, nil
	case 2:
		return Key{kind: kindPair, V: v}, nil
	}
	return Key{}, Errorf("%w: pg_locks objsubid %d is not an advisory lock key space (want 1 or 2)", ErrInvalidKey, objsubid)
}

// LockColumns returns the classid, objid and objsubid that k has in pg_locks.
func (k Key) LockColumns() (classid, objid uint32, objsubid int16) {
	objsubid = 1
	if k.kind == kindPair {
		objsubid = 2
	}
	return uint32(uint64(k.V) >> 32), uint32(k.V), objsubid
}

// Check returns an error wrapping ErrInvalidKey for the zero Key.
func (k Key) Check() error {
	if k.IsZero() {
		return Errorf("%w: the zero Key (or HashKey with no parts); build keys with HashKey, Int64Key or PairKey", ErrInvalidKey)
	}
	return nil
}

// CompareKeys is the canonical order of keys: all bigint keys by value, then
// all pair keys by (a, b). Every multi-key function takes keys in this order,
// so two callers locking overlapping sets can never deadlock each other.
func CompareKeys(x, y Key) int {
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
	return cmp.Compare(x.V, y.V)
}

// CanonicalKeys validates keys and returns a sorted, deduplicated copy. It
// returns an error wrapping ErrInvalidKey if keys is empty or holds an
// invalid key.
func CanonicalKeys(keys []Key) ([]Key, error) {
	switch len(keys) {
	case 0:
		return nil, Errorf("%w: no keys given", ErrInvalidKey)
	case 1:
		if err := keys[0].Check(); err != nil {
			return nil, err
		}
		return []Key{keys[0]}, nil
	}
	for i, k := range keys {
		if err := k.Check(); err != nil {
			return nil, Errorf("key %d of %d: %w", i+1, len(keys), err)
		}
	}
	out := slices.Clone(keys)
	slices.SortFunc(out, CompareKeys)
	return slices.Compact(out), nil
}

// MarshalText is the core of [pgcoord.Key.MarshalText], which documents it.
func (k Key) MarshalText() ([]byte, error) {
	if k.IsZero() {
		return []byte{}, nil
	}
	return []byte(k.String()), nil
}

// UnmarshalText is the core of [pgcoord.Key.UnmarshalText], which documents it.
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

// KeyList names keys as errors and logs do: one key by its String, more in
// brackets, the first few of a long list and how many more there are.
func KeyList(keys []Key) string {
	name := func(k Key) string {
		if k.Check() != nil {
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
