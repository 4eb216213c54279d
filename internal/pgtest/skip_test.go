package pgtest

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
)

// recordingT is the part of testing.TB that SkipOrFail uses; it records
// whether the test was skipped or failed, and with what.
type recordingT struct {
	testing.TB
	skipped, failed bool
	msg             string
}

func (r *recordingT) Helper()      {}
func (r *recordingT) Name() string { return "TestRecorded" }
func (r *recordingT) Skipf(format string, args ...any) {
	r.skipped, r.msg = true, fmt.Sprintf(format, args...)
	runtime.Goexit()
}
func (r *recordingT) Fatalf(format string, args ...any) {
	r.failed, r.msg = true, fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// SkipOrFail skips, saying why, and fails instead when CI is true.
func TestSkipOrFail(t *testing.T) {
	for _, tc := range []struct {
		ci   string
		fail bool
	}{{"", false}, {"false", false}, {"true", true}, {"1", true}} {
		t.Setenv("CI", tc.ci)
		skips.Lock()
		skips.why = nil
		skips.Unlock()
		r := &recordingT{}
		done := make(chan struct{})
		go func() {
			defer close(done)
			SkipOrFail(r, "needs %s", "a tool")
		}()
		<-done
		if r.failed != tc.fail || r.skipped == tc.fail || !strings.Contains(r.msg, "needs a tool") {
			t.Errorf("CI=%q: skipped %v, failed %v, message %q; want failed = %v, with the reason", tc.ci, r.skipped, r.failed, r.msg, tc.fail)
		}
		// A skip is in the summary that TestMain prints, with its reason.
		if got := SkipSummary(); r.skipped != strings.Contains(got, "  TestRecorded: needs a tool\n") {
			t.Errorf("CI=%q: skipped %v, but the summary is %q", tc.ci, r.skipped, got)
		}
	}
}
