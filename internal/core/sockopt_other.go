//go:build !linux

package core

import (
	"syscall"
	"time"
)

// setUserTimeout is a no-op where TCP_USER_TIMEOUT does not exist; keepalives
// and the heartbeat still bound loss detection.
func setUserTimeout(syscall.RawConn, time.Duration) error { return nil }
