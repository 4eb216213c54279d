//go:build !linux

package main

import "os/exec"

// dieWithParent does nothing: only Linux has a parent-death signal. The
// child still stops when its standard input closes, which it does when the
// parent exits.
func dieWithParent(*exec.Cmd) {}
