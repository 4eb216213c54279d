//go:build !linux

package pgcoord

import (
	"syscall"
	"time"
)

// setUserTimeout is a no-op where TCP_USER_TIMEOUT does not exist; keepalives
// and the heartbeat still bound loss detection.
func setUserTimeout(time.Duration) func(network, address string, rc syscall.RawConn) error {
	return nil
}
