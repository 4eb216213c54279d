package main

import (
	"os/exec"
	"syscall"
)

// dieWithParent has the kernel kill the child when the thread that
// started it exits; main locks itself to the main thread, which lives as
// long as the program.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
