//go:build !linux

package throwaway

import (
	"errors"
	"os"
	"syscall"
)

// osUser is the OS user the server runs as: always the current user here.
type osUser struct{}

// serverUser refuses root, which initdb and postgres refuse too; switching to
// the "postgres" user is implemented on Linux only.
func serverUser() (osUser, error) {
	if os.Geteuid() == 0 {
		return osUser{}, errors.New("throwaway: PostgreSQL refuses to run as root; run as another user or set DATABASE_URL")
	}
	return osUser{}, nil
}

func (osUser) chown(string) error { return nil }

// procAttr returns nil: there is no parent-death signal outside Linux, so a
// server outlives a program that dies without calling stop.
func (osUser) procAttr(syscall.Signal) *syscall.SysProcAttr { return nil }
