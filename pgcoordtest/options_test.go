package pgcoordtest

import (
	"strings"
	"testing"

	"github.com/pgcoord/pgcoord"
)

// Options that cannot work together, or that are invalid, are refused
// with a message that names them.
func TestOptionsSayNo(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []Option
		want string
	}{
		{"relative bin dir", []Option{WithBinDir("bin")}, "WithBinDir: dir must be an absolute path"},
		{"empty image", []Option{WithContainerImage("")}, "WithContainerImage: image is empty"},
		{"twice", []Option{FailIfUnavailable(), FailIfUnavailable()}, "FailIfUnavailable: given more than once"},
		{"no container and an image", []Option{WithoutContainer(), WithContainerImage("postgres:16")}, "WithoutContainer and WithContainerImage conflict"},
		{"nil", []Option{nil}, "nil Option"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := newConfig(tc.opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
	if _, err := newConfig([]Option{WithBinDir("/usr/bin"), WithContainerImage("postgres:16"), FailIfUnavailable()}); err != nil {
		t.Fatalf("valid options refused: %v", err)
	}
}

// The test binary has one server: options that would choose another one
// after it was chosen fail, naming both.
func TestServerOptionsAfterTheFirstCallMustAgree(t *testing.T) {
	DB(t) // chooses the server, if not done yet
	shared.mu.Lock()
	first := shared.cfg
	shared.mu.Unlock()
	other := first
	other.binDir = "/nonexistent/bin"
	_, err := sharedServer(other)
	if err == nil || !strings.Contains(err.Error(), `differ from`) || !strings.Contains(err.Error(), "/nonexistent/bin") {
		t.Fatalf("error %v, want one naming both sets of server options", err)
	}
	if _, err := sharedServer(first); err != nil {
		t.Fatalf("the same options again: %v", err)
	}
}

// TerminateBackends refuses a Client it does not know, and one with no
// dedicated backend, rather than ending nothing; when the pool's
// application_name hides the dedicated backends, it says so.
func TestTerminateBackendsRefusesWhatItCannotEnd(t *testing.T) {
	dsn := DB(t)
	foreign, err := pgcoord.New(Pool(t, dsn))
	if err != nil {
		t.Fatal(err)
	}
	defer foreign.Close(t.Context())
	idle := Client(t, dsn)
	// Its pool's application_name is the dedicated backends' one
	// ("pgcoord"), by which TerminateBackends tells the pool's apart.
	sep := " " // a keyword/value string
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		sep = "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
	}
	sameApp := Client(t, dsn+sep+"application_name=pgcoord")
	if _, err := sameApp.Lock(t.Context(), pgcoord.HashKey("same application_name")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		c    *pgcoord.Client
		want string
	}{
		{"made by pgcoord.New", foreign, "was not made by pgcoordtest.Client"},
		{"without backends", idle, "has no dedicated backend"},
		{"pool named like its backends", sameApp, `application_name "pgcoord"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &recordingT{}
			done := make(chan struct{})
			go func() {
				defer close(done)
				TerminateBackends(r, tc.c)
			}()
			<-done
			if !r.failed || !strings.Contains(r.msg, tc.want) {
				t.Fatalf("failed %v with %q; want a failure saying %q", r.failed, r.msg, tc.want)
			}
		})
	}
}
