//go:build !linux

package pgtest

import (
	"errors"
	"syscall"
)

// setPdeathsig does nothing: only Linux has a parent-death signal. A server
// outlives a test binary that dies without running its cleanups, and a
// later run removes its directory once it is gone.
func setPdeathsig(*syscall.SysProcAttr, syscall.Signal) {}

// memoryTempDir returns "": pgtest knows a memory file system only on Linux.
func memoryTempDir(uint64) string { return "" }

// clusterProcesses is not available without /proc; after a crash, the
// restart retries until the old processes have released the cluster.
func clusterProcesses(string) ([]int, error) {
	return nil, errors.New("no process table")
}
