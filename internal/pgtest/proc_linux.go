package pgtest

import (
	"os"
	"strconv"
	"syscall"
)

// shmDir is the memory file system of Linux systems.
const shmDir = "/dev/shm"

// memoryTempDir returns /dev/shm if it is a memory file system (tmpfs) that
// every user may write and that has at least minFree bytes available, and
// "" otherwise.
func memoryTempDir(minFree uint64) string {
	const tmpfsMagic = 0x01021994
	var st syscall.Statfs_t
	if err := syscall.Statfs(shmDir, &st); err != nil || st.Type != tmpfsMagic {
		return ""
	}
	if st.Bavail*uint64(st.Bsize) < minFree {
		return ""
	}
	fi, err := os.Stat(shmDir)
	if err != nil || fi.Mode()&os.ModeSticky == 0 || fi.Mode().Perm()&0o003 != 0o003 {
		return ""
	}
	return shmDir
}

// setPdeathsig asks the kernel to send sig to the child when the thread
// that started it exits.
func setPdeathsig(attr *syscall.SysProcAttr, sig syscall.Signal) {
	attr.Pdeathsig = sig
}

// clusterProcesses returns the processes whose working directory is data:
// a postmaster and every one of its children, which inherit its chdir.
func clusterProcesses(data string) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if cwd, err := os.Readlink("/proc/" + e.Name() + "/cwd"); err == nil && cwd == data {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}
