package core

import (
	"syscall"
	"time"
)

// tcpUserTimeout is TCP_USER_TIMEOUT from linux/tcp.h; package syscall does
// not define it.
const tcpUserTimeout = 18

// setUserTimeout sets TCP_USER_TIMEOUT on a socket, so data (or keepalive
// probes) left unacknowledged for d fails the socket instead of waiting for
// the kernel's default of minutes.
func setUserTimeout(rc syscall.RawConn, d time.Duration) error {
	var serr error
	err := rc.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, tcpUserTimeout, int(d.Milliseconds()))
	})
	if err != nil {
		return err
	}
	return serr
}
