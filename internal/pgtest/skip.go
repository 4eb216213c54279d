package pgtest

import (
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// SkipOrFail is for a test that cannot run here because something it needs
// is missing: a tool, a privilege, a server of its own. It skips t with a
// message that says so and why (why is formatted like fmt.Sprintf), or,
// when the environment variable CI is true, fails t with that message
// instead: a CI run must run every test, and a skip there would pass
// without checking anything.
func SkipOrFail(t testing.TB, format string, args ...any) {
	t.Helper()
	why := fmt.Sprintf(format, args...)
	if underCI() {
		t.Fatalf("cannot run: %s (CI=%s: a test that cannot run fails instead of skipping)", why, os.Getenv("CI"))
	}
	recordSkip(t.Name(), why)
	t.Skipf("skipped: %s", why)
}

// skips holds the tests that SkipOrFail skipped in this test binary, with
// why, for SkipSummary.
var skips struct {
	sync.Mutex
	why map[string]string // by test name
}

func recordSkip(name, why string) {
	skips.Lock()
	defer skips.Unlock()
	if skips.why == nil {
		skips.why = map[string]string{}
	}
	skips.why[name] = why
}

// SkipSummary returns the tests that SkipOrFail skipped so far in this test
// binary, one line each with why, under a line that counts them; "" when it
// skipped none.
func SkipSummary() string {
	skips.Lock()
	defer skips.Unlock()
	if len(skips.why) == 0 {
		return ""
	}
	names := make([]string, 0, len(skips.why))
	for name := range skips.why {
		names = append(names, name)
	}
	sort.Strings(names)
	var b strings.Builder
	fmt.Fprintf(&b, "%d test(s) skipped, each for something this machine lacks (CI=true fails them instead):\n", len(names))
	for _, name := range names {
		fmt.Fprintf(&b, "  %s: %s\n", name, skips.why[name])
	}
	return b.String()
}

// ReportSkips writes SkipSummary, if any test was skipped, where the person
// who ran go test sees it: go test shows the output of a package that
// passed only under -v (or -json), so without -v it goes to the terminal
// (/dev/tty), and to stderr when there is none or under -v. A TestMain
// calls it after m.Run.
func ReportSkips() {
	summary := SkipSummary()
	if summary == "" {
		return
	}
	var w io.Writer = os.Stderr
	if !testing.Verbose() {
		if tty, err := os.OpenFile("/dev/tty", os.O_WRONLY, 0); err == nil {
			defer tty.Close()
			w = tty
		}
	}
	fmt.Fprint(w, summary)
}

// underCI reports whether the environment variable CI is true.
func underCI() bool {
	ci, _ := strconv.ParseBool(os.Getenv("CI"))
	return ci
}
