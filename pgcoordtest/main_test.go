package pgcoordtest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestMain runs the tests with Main, which stops the server after them,
// or, in a child process of a test, that test's helper.
func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(unavailableHelper(mode))
	}
	if mode := os.Getenv(urlHelperEnv); mode != "" {
		os.Exit(urlHelper(mode))
	}
	if os.Getenv(mainHelperEnv) != "" {
		Main(mainHelper{})
	}
	Main(m)
}

// mainHelperEnv runs the test binary as Main(mainHelper{}) (see TestMain).
const mainHelperEnv = "PGCOORDTEST_MAIN_HELPER"

// mainHelper is the tests that Main runs in the child: they start the
// server, as a first DB call does, print where it is, and return 3.
type mainHelper struct{}

func (mainHelper) Run() int {
	s, err := sharedServer(serverConfig{binDir: os.Getenv(EnvBinDir)})
	if err != nil {
		fmt.Println(err)
		return 1
	}
	fmt.Printf("CHILD pid=%d admin=%s\n", os.Getpid(), s.found.Admin)
	return 3
}

// Main exits with the code of the tests, having stopped the server they
// started from local binaries and removed its directory, at once.
func TestMainStopsTheServerAndRemovesItsFiles(t *testing.T) {
	localTestServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0])
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case EnvDatabaseURL, EnvProjectDatabaseURL, "CI", helperEnv, urlHelperEnv, mainHelperEnv:
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, mainHelperEnv+"=1")
	out, err := cmd.CombinedOutput()
	if code := cmd.ProcessState.ExitCode(); code != 3 {
		t.Fatalf("Main exited with %d (%v), want the tests' 3:\n%s", code, err, out)
	}
	fields := map[string]string{}
	for _, line := range strings.Split(string(out), "\n") {
		if rest, ok := strings.CutPrefix(line, "CHILD "); ok {
			for _, f := range strings.Fields(rest) {
				k, v, _ := strings.Cut(f, "=")
				fields[k] = v
			}
		}
	}
	if fields["admin"] == "" {
		t.Fatalf("the child printed no CHILD line:\n%s", out)
	}
	if dirs := ownedDirs(t, fields["pid"]); len(dirs) != 0 {
		t.Errorf("directories %v of the child's server remain after Main", dirs)
	}
	pctx, pcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer pcancel()
	if conn, err := pgx.Connect(pctx, fields["admin"]); err == nil {
		_ = conn.Close(pctx)
		t.Errorf("the child's server still answers after Main returned")
	}
}
