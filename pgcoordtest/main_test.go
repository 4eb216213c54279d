package pgcoordtest

import (
	"os"
	"testing"
)

// TestMain runs the tests with Main, which stops the server after them,
// or, in a child process of the tests of unavailable, the helper.
func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(unavailableHelper(mode))
	}
	Main(m)
}
