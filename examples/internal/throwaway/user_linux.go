//go:build linux

package throwaway

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"syscall"
)

// osUser is the OS user the server runs as: nil cred for the current user.
type osUser struct{ cred *syscall.Credential }

// serverUser returns the current user, or "postgres" when running as root,
// since initdb and postgres refuse to run as root.
func serverUser() (osUser, error) {
	if os.Geteuid() != 0 {
		return osUser{}, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return osUser{}, fmt.Errorf("throwaway: running as root, and PostgreSQL refuses to run as root; no OS user \"postgres\" to run it as: %w", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return osUser{}, fmt.Errorf("throwaway: user postgres: %w", err)
	}
	return osUser{&syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}, nil
}

// chown gives dir to the server's user.
func (u osUser) chown(dir string) error {
	if u.cred == nil {
		return nil
	}
	return os.Chown(dir, int(u.cred.Uid), int(u.cred.Gid))
}

// procAttr runs a child as the server's user, with deathSig sent to it when
// the thread that started it exits.
func (u osUser) procAttr(deathSig syscall.Signal) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: u.cred, Pdeathsig: deathSig}
}
