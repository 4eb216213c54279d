package pgcoordtest

import (
	"os"
	"testing"
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
	Main(m)
}
