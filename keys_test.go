package pgcoord

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/cespare/xxhash/v2"
	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// HashKey is frozen: these values must never change, or processes of two
// versions would lock different keys for the same name. They were checked
// against an independent implementation of the algorithm in the README.
func TestHashKeyGoldenVectors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		parts []string
		want  int64
	}{
		{[]string{""}, 7076881815233712691},
		{[]string{"a"}, -602310095049900750},
		{[]string{"invoice", "42"}, 6345862734762165923},
		{[]string{"ab", "c"}, -3801889360486250112},
		{[]string{"a", "bc"}, -7435443978566334651},
		{[]string{"a", ""}, 1734695122466066874},
		{[]string{"", "a"}, 8051804645493330359},
		{[]string{"scheduler"}, 5541286810724847924},
		{[]string{"héllo", "世界"}, 8009150299975479239},
		{[]string{"nul\x00byte"}, -4450333841839971854},
	} {
		got, ok := HashKey(tc.parts...).Int64()
		if !ok || got != tc.want {
			t.Errorf("HashKey(%q) = %d (bigint %v), want %d", tc.parts, got, ok, tc.want)
		}
	}
	// The hash is plain xxhash64 with seed 0 (its published empty-input
	// value), over the documented encoding.
	if got := xxhash.Sum64(nil); got != 0xEF46DB3751D8E999 {
		t.Fatalf("xxhash64(\"\") = %#x", got)
	}
	want := []byte("pgcoord.HashKey.v1\x00\x00\x00\x00\x00\x00\x00\x07invoice\x00\x00\x00\x00\x00\x00\x00\x0242")
	if got := core.HashInput([]string{"invoice", "42"}); !bytes.Equal(got, want) {
		t.Fatalf("hashInput = %q, want %q", got, want)
	}
}

func TestKeyBasics(t *testing.T) {
	t.Parallel()
	if !HashKey().IsZero() || !(Key{}).IsZero() {
		t.Fatal("HashKey() and the zero Key must be invalid")
	}
	if err := (Key{}).coreKey().Check(); !errors.Is(err, ErrInvalidKey) {
		t.Fatalf("zero Key check: %v", err)
	}
	if Int64Key(1<<32|2) == PairKey(1, 2) {
		t.Fatal("Int64Key and PairKey with the same bits compare equal")
	}
	for _, s := range []string{"", "42", "int64:", "int64:x", "int64:99999999999999999999", "pair:1", "pair:1,x", "pair:4294967296,1", "blob:1"} {
		if _, err := ParseKey(s); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("ParseKey(%q): %v, want ErrInvalidKey", s, err)
		}
	}
	if _, err := KeyFromLock(0, 0, 3); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("KeyFromLock with objsubid 3: %v", err)
	}
	// The cached one-key statements match what the builder writes.
	for _, fn := range []string{"pg_try_advisory_lock", "pg_try_advisory_lock_shared", "pg_advisory_unlock", "pg_advisory_unlock_shared"} {
		for _, k := range []Key{Int64Key(-3), PairKey(-1, 2)} {
			fast, fastArgs := core.UnlockSQL(fn, coreKeys([]Key{k}), 7)
			var b strings.Builder
			b.WriteString("SELECT ")
			slow, slowArgs := core.Guard(&b, core.SelectKeys(&b, fn, coreKeys([]Key{k}), nil), 7)
			if fast != slow || fmt.Sprint(fastArgs) != fmt.Sprint(slowArgs) {
				t.Errorf("unlockSQL(%s, %v) = %q %v, builder gives %q %v", fn, k, fast, fastArgs, slow, slowArgs)
			}
		}
	}
	// Every function of one key the lock core calls, in each form, has
	// its text cached once built, for each key form.
	fns := []string{core.UnlockFunc(false), core.UnlockFunc(true)}
	for _, shared := range []bool{false, true} {
		for _, try := range []bool{false, true} {
			fns = append(fns, core.LockFunc(shared, try))
		}
	}
	for _, fn := range fns {
		for fi, form := range core.SingleKeyForms {
			for _, k := range []Key{Int64Key(-3), PairKey(-1, 2)} {
				f := slices.Index(core.KeyFuncs[:], fn)
				if f < 0 {
					t.Fatalf("%s is not among keyFuncs: its statements are built anew each time", fn)
				}
				first, _ := core.SingleKeySQL(fn, form, k.coreKey(), 7)
				_, _, pair := k.Pair()
				if cached := core.SingleKeyTexts[f][fi][core.B2i(pair)].Load(); cached == nil || *cached != first {
					t.Errorf("singleKeySQL(%s, %q, %v) = %q, cached %v", fn, form, k, first, cached)
				}
			}
		}
	}
	got, err := core.CanonicalKeys(coreKeys([]Key{PairKey(1, 1), Int64Key(5), Int64Key(-5), PairKey(-1, 9), Int64Key(5)}))
	if err != nil {
		t.Fatal(err)
	}
	want := coreKeys([]Key{Int64Key(-5), Int64Key(5), PairKey(-1, 9), PairKey(1, 1)})
	if len(got) != len(want) {
		t.Fatalf("canonicalKeys = %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("canonicalKeys = %v, want %v", got, want)
		}
	}
}

// Keys go through PostgreSQL and back: a lock taken with each kind of key
// shows in pg_locks with columns that decode to the same Key.
func TestKeysRoundTripThroughPgLocks(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	conn := pgtest.Conn(t, dsn)
	var pid int32
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	keys := []Key{
		HashKey("invoice", "42"),
		Int64Key(-7),
		Int64Key(1<<40 + 3),
		Int64Key(math.MinInt64),
		Int64Key(math.MaxInt64),
		PairKey(1, 2),
		PairKey(-1, math.MinInt32),
	}
	for _, k := range keys {
		sql, args := core.LockSQL("pg_advisory_lock", coreKeys([]Key{k}))
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	state := lockState(t, dsn)
	for _, k := range keys {
		rows := state[k]
		if len(rows) != 1 || rows[0].pid != pid || !rows[0].granted {
			t.Errorf("%v: pg_locks rows %+v, want one granted to %d", k, rows, pid)
		}
	}
	if len(state) != len(keys) {
		t.Errorf("pg_locks decodes to %d keys, want %d: %v", len(state), len(keys), state)
	}

	// The two key spaces never conflict: while PairKey(1, 2) is held, a
	// bigint key with the same 64 bits is free.
	other := pgtest.Conn(t, dsn)
	var got bool
	if err := other.QueryRow(ctx, "SELECT pg_try_advisory_lock($1::int8)", int64(1<<32|2)).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if !got {
		t.Fatal("Int64Key(1<<32|2) conflicted with PairKey(1, 2)")
	}
	state = lockState(t, dsn)
	if len(state[Int64Key(1<<32|2)]) != 1 || len(state[PairKey(1, 2)]) != 1 {
		t.Fatalf("pg_locks should show both keys separately: %v", state)
	}
}

func FuzzKeyRoundTrip(f *testing.F) {
	f.Add(int64(0), int32(0), int32(0))
	f.Add(int64(-1), int32(-1), int32(math.MinInt32))
	f.Add(int64(math.MinInt64), int32(math.MaxInt32), int32(7))
	f.Fuzz(func(t *testing.T, v int64, a, b int32) {
		for _, k := range []Key{Int64Key(v), PairKey(a, b)} {
			classid, objid, objsubid := k.coreKey().LockColumns()
			back, err := KeyFromLock(classid, objid, objsubid)
			if err != nil || back != k {
				t.Fatalf("%v -> (%d, %d, %d) -> %v, %v", k, classid, objid, objsubid, back, err)
			}
			parsed, err := ParseKey(k.String())
			if err != nil || parsed != k {
				t.Fatalf("ParseKey(%q) = %v, %v", k.String(), parsed, err)
			}
			text, err := k.MarshalText()
			var back2 Key
			if err != nil || string(text) != k.String() || back2.UnmarshalText(text) != nil || back2 != k {
				t.Fatalf("%v: MarshalText %q, %v; UnmarshalText -> %v", k, text, err, back2)
			}
		}
		if x, y, _ := PairKey(a, b).Pair(); x != a || y != b {
			t.Fatalf("PairKey(%d, %d).Pair() = %d, %d", a, b, x, y)
		}
	})
}

// FuzzParseKey: any string either parses to a key that prints back as a
// string that parses to the same key, or is rejected with ErrInvalidKey.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"int64:1", "pair:1,2", "pair:-1,-2", "int64:-9223372036854775808", "x", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		k, err := ParseKey(s)
		if err != nil {
			if !errors.Is(err, ErrInvalidKey) {
				t.Fatalf("ParseKey(%q): %v, want ErrInvalidKey", s, err)
			}
			return
		}
		again, err := ParseKey(k.String())
		if err != nil || again != k {
			t.Fatalf("ParseKey(%q) = %v; reparsed %v, %v", s, k, again, err)
		}
	})
}

// FuzzHashInputUnambiguous: the encoding of a part list can be split back
// into exactly those parts, so two different lists never hash the same
// input.
func FuzzHashInputUnambiguous(f *testing.F) {
	f.Add("ab", "c", 2)
	f.Add("", "", 1)
	f.Add("a\x00", "b", 3)
	f.Fuzz(func(t *testing.T, a, b string, n int) {
		parts := []string{a, b, a + b}[:1+abs(n)%3]
		in := core.HashInput(parts)
		rest, ok := bytes.CutPrefix(in, []byte(core.HashDomain))
		if !ok {
			t.Fatal("missing domain prefix")
		}
		var back []string
		for len(rest) > 0 {
			if len(rest) < 8 {
				t.Fatalf("truncated length in %q", in)
			}
			l := binary.BigEndian.Uint64(rest)
			rest = rest[8:]
			if uint64(len(rest)) < l {
				t.Fatalf("part overruns input %q", in)
			}
			back = append(back, string(rest[:l]))
			rest = rest[l:]
		}
		if len(back) != len(parts) {
			t.Fatalf("decoded %q from %q", back, parts)
		}
		for i := range parts {
			if back[i] != parts[i] {
				t.Fatalf("decoded %q from %q", back, parts)
			}
		}
	})
}

func abs(n int) int {
	if n < 0 {
		return -n
	}
	return n
}

// Key parts are hashed, never sent to the server: hostile strings give
// ordinary, distinct keys.
func TestHashKeyHostileParts(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	dsn := pgtest.DB(t)
	c := newTestClient(t, dsn)
	big := string(bytes.Repeat([]byte("x'; DROP TABLE t; --"), 512)) // 10 kB
	parts := [][]string{
		{"'; DROP DATABASE postgres; --"},
		{"nul\x00inside"},
		{"\xff\xfe invalid utf-8"},
		{big},
		{big, big},
		{""},
	}
	seen := make(map[Key][]string)
	for _, p := range parts {
		k := HashKey(p...)
		if k.IsZero() {
			t.Fatalf("HashKey(%.20q...) is invalid", p)
		}
		if prev, dup := seen[k]; dup {
			t.Fatalf("HashKey collision between %.20q and %.20q", prev, p)
		}
		seen[k] = p
		l, err := c.Lock(ctx, k)
		if err != nil {
			t.Fatalf("Lock(HashKey(%.20q...)): %v", p, err)
		}
		heldOnlyBy(t, dsn, k, l.core.S.PID())
		mustUnlock(t, l)
	}
}

// A Key is text in JSON, as a value and as a map key, in the form of
// String; the zero Key is empty text.
func TestKeyJSON(t *testing.T) {
	type job struct {
		Key    Key
		Keys   []Key
		Owners map[Key]string
		None   Key
	}
	in := job{
		Key:    HashKey("report", "daily"),
		Keys:   []Key{Int64Key(-1), PairKey(-2, 3)},
		Owners: map[Key]string{PairKey(1, 2): "a", Int64Key(5): "b"},
	}
	b, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"Key":"int64:6223870854755599160","Keys":["int64:-1","pair:-2,3"],"Owners":{"int64:5":"b","pair:1,2":"a"},"None":""}`
	if string(b) != want {
		t.Errorf("json.Marshal:\n got %s\nwant %s", b, want)
	}
	var out job
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	if out.Key != in.Key || len(out.Keys) != 2 || out.Keys[0] != in.Keys[0] || out.Keys[1] != in.Keys[1] ||
		len(out.Owners) != 2 || out.Owners[PairKey(1, 2)] != "a" || out.Owners[Int64Key(5)] != "b" || !out.None.IsZero() {
		t.Errorf("round trip: got %+v, want %+v", out, in)
	}
	for _, bad := range []string{`{"Key":"42"}`, `{"Key":"pair:1"}`, `{"Key":7}`} {
		var j job
		err := json.Unmarshal([]byte(bad), &j)
		if err == nil || (bad != `{"Key":7}` && !errors.Is(err, ErrInvalidKey)) {
			t.Errorf("json.Unmarshal(%s): %v, want an error wrapping ErrInvalidKey", bad, err)
		}
	}
}

// A Key prints as it always did under %#v (its two fields), and a nil
// *Key refuses text it cannot parse with an error, before it would write.
func TestKeyFormatAndNilUnmarshal(t *testing.T) {
	if got := fmt.Sprintf("%#v", Int64Key(7)); got != "pgcoord.Key{kind:0x1, v:7}" {
		t.Errorf("%%#v of Int64Key(7) = %s, want pgcoord.Key{kind:0x1, v:7}", got)
	}
	if got := fmt.Sprintf("%#v", PairKey(1, 2)); got != "pgcoord.Key{kind:0x2, v:4294967298}" {
		t.Errorf("%%#v of PairKey(1, 2) = %s, want pgcoord.Key{kind:0x2, v:4294967298}", got)
	}
	var k *Key
	if err := k.UnmarshalText([]byte("bad")); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("nil *Key: UnmarshalText(bad) = %v, want an error wrapping ErrInvalidKey", err)
	}
}
