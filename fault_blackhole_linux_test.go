package pgcoord

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgcoord/pgcoord/internal/core"

	"github.com/pgcoord/pgcoord/internal/pgtest"
)

// faultNetnsEnv marks a run of the test binary inside a network namespace
// of its own.
const faultNetnsEnv = "PGCOORD_FAULT_NETNS"

// A network blackhole between a holder and the server: packets of the
// holder's connections are dropped in both directions, so that neither
// side hears anything, not even TCP acknowledgements (pgtest's Proxy
// cannot do that: its kernel still acknowledges the server, see
// TestLossOnSilentNetwork). With loss deadline L = 2 s and heartbeat
// H = 250 ms:
//
//   - the holder reports ErrLockLost within L + H of the blackhole;
//   - the server keeps the holder's backend, and its lock, until its TCP
//     keepalives give up: within serverBound(L) = 2L = 4 s, plus a second
//     of slack for a loaded machine;
//   - a contender that waits all along acquires only after the old backend
//     has gone, and after the holder reported the loss.
//
// Dropping packets needs nftables and a network namespace, so the test
// runs itself again in a new one, as root, with a private server on that
// namespace's loopback; the rules go with the namespace.
func TestFaultBlackhole(t *testing.T) {
	if os.Getenv(faultNetnsEnv) == "" {
		runInNetns(t)
		return
	}
	ctx := testCtx(t)
	if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
		t.Fatalf("ip link set lo up: %v: %s", err, out)
	}
	srv := pgtest.NewServer(t)
	dsn := srv.DB(t)
	migrated(t, dsn)
	const loss, beat = 2 * time.Second, 250 * time.Millisecond
	holder := newTestClient(t, dsn, WithLossDeadline(loss), WithHeartbeat(beat), WithApplicationName("blackholed"))
	contender := newTestClient(t, dsn)
	target := lockTarget{"blackhole"}
	h, err := target.acquire(ctx, holder)
	if err != nil {
		t.Fatal(err)
	}
	oldPID := h.pid()
	ch := startContender(t, ctx, target, contender, dsn)

	// Every connection of the holder's Client, by its port on the client side.
	admin := pgtest.Conn(t, dsn)
	rows, err := admin.Query(ctx, "SELECT client_port FROM pg_stat_activity WHERE application_name = 'blackholed'")
	if err != nil {
		t.Fatal(err)
	}
	var ports []int
	for rows.Next() {
		var p int
		if err := rows.Scan(&p); err != nil {
			t.Fatal(err)
		}
		ports = append(ports, p)
	}
	if rows.Err() != nil || len(ports) == 0 {
		t.Fatalf("ports of the holder's connections: %v, %v", ports, rows.Err())
	}
	nft := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("nft", args...).CombinedOutput(); err != nil {
			t.Fatalf("nft %v: %v: %s", args, err, out)
		}
	}
	nft("add", "table", "inet", "blackhole")
	nft("add", "chain", "inet", "blackhole", "in", "{ type filter hook input priority 0; }")
	start := time.Now()
	for _, p := range ports {
		for _, dir := range []string{"sport", "dport"} {
			nft("add", "rule", "inet", "blackhole", "in", "tcp", dir, strconv.Itoa(p), "drop")
		}
	}

	select {
	case <-h.Done():
	case r := <-ch:
		t.Fatalf("the contender acquired (%v) before the holder reported its loss", r.err)
	case <-time.After(testTimeout):
		t.Fatal("the holder never reported the loss")
	}
	lost := leaseLostAt(t, h.(lockHold).core.S) // by the library's clock
	if !errors.Is(h.Err(), ErrLockLost) {
		t.Fatalf("holder: %v, want ErrLockLost", h.Err())
	}
	t.Logf("holder reported the loss %v into the blackhole: %v", lost.Sub(start).Round(time.Millisecond), h.Err())
	if took := lost.Sub(start); took > loss+beat {
		t.Errorf("holder reported the loss %v into the blackhole, want within L + H = %v", took, loss+beat)
	}
	// The server still has the old backend and its lock, and the
	// contender waits for it. The contender's wait is a series of
	// statements, each bounded by lock_timeout (see Session.block), so a
	// sample can fall between two of them: poll until one shows it
	// waiting, and check every sample's holder.
	pgtest.Eventually(t, time.Second, "pg_locks to show the old backend holding and the contender waiting", func() bool {
		pids, waiting := target.holders(t, dsn)
		if len(pids) != 1 || pids[0] != oldPID {
			t.Fatalf("pg_locks after the holder gave up: held by %v, want the old backend %d", pids, oldPID)
		}
		return waiting == 1
	})

	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	dropped := r.at.Sub(start)
	t.Logf("contender acquired %v into the blackhole, %v after the holder knew", dropped.Round(time.Millisecond), r.at.Sub(lost).Round(time.Millisecond))
	if bound := core.ServerBound(loss) + time.Second; dropped > bound {
		t.Errorf("contender acquired %v into the blackhole, want within 2L (+1s) = %v", dropped, bound)
	}
	if !r.at.After(lost) {
		t.Errorf("contender acquired at %v, before the holder reported the loss at %v", r.at, lost)
	}
	// The server frees the old backend's locks as that backend exits,
	// a moment before the backend leaves pg_stat_activity: it is gone
	// within a second of the contender's grant.
	pgtest.Eventually(t, time.Second, fmt.Sprintf("the old backend %d to leave pg_stat_activity after the contender acquired", oldPID), func() bool {
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", oldPID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	if pids, _ := target.holders(t, dsn); len(pids) != 1 || pids[0] != r.h.pid() {
		t.Fatalf("pg_locks: held by %v, want the contender's backend %d", pids, r.h.pid())
	}
	if r.h.Fence() <= h.Fence() {
		t.Fatalf("contender's fence %d, not above %d", r.h.Fence(), h.Fence())
	}
	if err := r.h.release(ctx); err != nil {
		t.Fatal(err)
	}
}

// runInNetns runs the calling test again in a network namespace of its
// own, and fails the test with the run's output if that run fails. A run
// that skipped (no server of its own, for instance) skips the calling test
// with its reason, or fails it under CI.
func runInNetns(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		pgtest.SkipOrFail(t, "%s needs root: it makes a network namespace and drops packets in it with nftables", t.Name())
	}
	for _, tool := range []struct{ name, pkg string }{{"ip", "iproute2"}, {"nft", "nftables"}} {
		if _, err := exec.LookPath(tool.name); err != nil {
			pgtest.SkipOrFail(t, "%s needs %s, which was not found (Debian: apt-get install %s): %v", t.Name(), tool.name, tool.pkg, err)
		}
	}
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1", "-test.timeout=5m")
	cmd.Env = append(os.Environ(), faultNetnsEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	p := pgtest.StartProcess(t, cmd)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var passed, skipped bool
	var why []string
	for {
		select {
		case line, ok := <-p.Lines():
			if ok {
				t.Log(line)
				passed = passed || strings.HasPrefix(line, "--- PASS: "+t.Name()+" ")
				skipped = skipped || strings.HasPrefix(line, "--- SKIP: "+t.Name()+" ")
				if strings.Contains(line, "skipped: ") {
					why = append(why, strings.TrimSpace(line))
				}
				continue
			}
		case <-ctx.Done():
			t.Fatal("the run in the network namespace did not finish in time")
		}
		break
	}
	<-p.Exited()
	if err := p.ExitErr(); err != nil {
		t.Fatalf("the run in the network namespace failed: %v\n%s", err, p.Stderr())
	}
	if skipped {
		pgtest.SkipOrFail(t, "the run in the network namespace skipped: %s", strings.Join(why, "; "))
	}
	if !passed {
		t.Fatalf("the run in the network namespace did not report that %s passed", t.Name())
	}
}
