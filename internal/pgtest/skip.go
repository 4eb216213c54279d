package pgtest

import (
	"fmt"
	"os"
	"strconv"
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
	t.Skipf("skipped: %s", why)
}

// underCI reports whether the environment variable CI is true.
func underCI() bool {
	ci, _ := strconv.ParseBool(os.Getenv("CI"))
	return ci
}
