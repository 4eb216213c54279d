package pgtest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Layout of a pgtest directory, made by os.MkdirTemp(baseDir(), dirPrefix+"*").
const (
	dirPrefix = "pgtest-"
	ownerFile = "pgtest.owner" // pid of the test binary that made the directory
	dataDir   = "data"         // the cluster
	sockDir   = "sock"         // unix_socket_directories
	logFile   = "postgres.log" // stdout and stderr of postgres and the tools
	staleAge  = 5 * time.Minute
)

// serverSettings go into postgresql.conf of every cluster; port and socket
// directory are given on the command line because they differ per server.
const serverSettings = `
# pgtest: a throwaway cluster for tests.
listen_addresses = '127.0.0.1'
max_connections = 400
shared_buffers = 32MB
huge_pages = off
fsync = off
full_page_writes = off
wal_level = replica
max_wal_senders = 5
max_wal_size = 256MB
hot_standby = on
dynamic_shared_memory_type = mmap
autovacuum = off
logging_collector = off
`

// hbaConf trusts every local and 127.0.0.1 connection, replication included.
const hbaConf = `# pgtest: trust everything local.
local   all          all                 trust
host    all          all   127.0.0.1/32  trust
local   replication  all                 trust
host    replication  all   127.0.0.1/32  trust
`

// binaries are the PostgreSQL programs pgtest runs.
type binaries struct {
	initdb, postgres, pgCtl, pgBasebackup string
}

// findBinaries looks in PGTEST_PG_BINDIR, then PATH, then the newest
// /usr/lib/postgresql/*/bin.
func findBinaries() (binaries, error) {
	if dir := os.Getenv("PGTEST_PG_BINDIR"); dir != "" {
		b, err := binariesIn(dir)
		if err != nil {
			return b, fmt.Errorf("PGTEST_PG_BINDIR=%s: %w", dir, err)
		}
		return b, nil
	}
	var reasons []string
	if b, err := binariesInPath(); err == nil {
		return b, nil
	} else {
		reasons = append(reasons, "PATH: "+err.Error())
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, dir := range dirs {
		b, err := binariesIn(dir)
		if err == nil {
			return b, nil
		}
		reasons = append(reasons, dir+": "+err.Error())
	}
	if len(dirs) == 0 {
		reasons = append(reasons, "/usr/lib/postgresql/*/bin: no such directory")
	}
	return binaries{}, errors.New("not found (PGTEST_PG_BINDIR not set; " + strings.Join(reasons, "; ") + ")")
}

// versionOf returns the major version in /usr/lib/postgresql/<v>/bin.
func versionOf(dir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(dir)), 64)
	return v
}

func binariesIn(dir string) (binaries, error) {
	var b binaries
	for _, p := range []struct {
		name string
		dst  *string
	}{{"initdb", &b.initdb}, {"postgres", &b.postgres}, {"pg_ctl", &b.pgCtl}} {
		path := filepath.Join(dir, p.name)
		if err := isExecutable(path); err != nil {
			return b, err
		}
		*p.dst = path
	}
	b.pgBasebackup = filepath.Join(dir, "pg_basebackup")
	return b, nil
}

func binariesInPath() (binaries, error) {
	var b binaries
	for _, p := range []struct {
		name string
		dst  *string
	}{{"initdb", &b.initdb}, {"postgres", &b.postgres}, {"pg_ctl", &b.pgCtl}} {
		path, err := exec.LookPath(p.name)
		if err != nil {
			return b, fmt.Errorf("%s not found", p.name)
		}
		*p.dst = path
	}
	// pg_basebackup lives next to the real postgres, which PATH may reach
	// through a symlink.
	b.pgBasebackup = "pg_basebackup"
	if real, err := filepath.EvalSymlinks(b.postgres); err == nil {
		if path := filepath.Join(filepath.Dir(real), "pg_basebackup"); isExecutable(path) == nil {
			b.pgBasebackup = path
		}
	}
	if b.pgBasebackup == "pg_basebackup" {
		if path, err := exec.LookPath("pg_basebackup"); err == nil {
			b.pgBasebackup = path
		}
	}
	return b, nil
}

func isExecutable(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("no %s", path)
	}
	if fi.IsDir() || fi.Mode()&0o111 == 0 {
		return fmt.Errorf("%s is not executable", path)
	}
	return nil
}

// osUser is the OS account that runs the PostgreSQL programs.
type osUser struct {
	name     string
	cred     *syscall.Credential // nil: run as the current user
	uid, gid int
}

// findOSUser returns the current user, or, when running as root (which
// initdb and postgres refuse), PGTEST_OS_USER or postgres.
func findOSUser() (osUser, error) {
	if os.Geteuid() != 0 {
		return osUser{name: "current user", uid: -1, gid: -1}, nil
	}
	name := os.Getenv("PGTEST_OS_USER")
	if name == "" {
		name = "postgres"
	}
	u, err := user.Lookup(name)
	if err != nil {
		return osUser{}, fmt.Errorf("running as root, and PostgreSQL refuses to run as root, but OS user %q does not exist (create it or set PGTEST_OS_USER): %w", name, err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return osUser{}, fmt.Errorf("OS user %q has a non-numeric uid or gid", name)
	}
	if uid == 0 {
		return osUser{}, fmt.Errorf("OS user %q is root, which PostgreSQL refuses; set PGTEST_OS_USER to another user", name)
	}
	return osUser{
		name: name,
		cred: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{uint32(gid)}},
		uid:  int(uid),
		gid:  int(gid),
	}, nil
}

// chown gives path to the OS user, if it is not the current user.
func (u osUser) chown(path string) error {
	if u.cred == nil {
		return nil
	}
	return os.Lchown(path, u.uid, u.gid)
}

// local is what every local server of the process shares: the programs, the
// OS user, and a cluster made once by initdb that servers copy.
type local struct {
	bin      binaries
	user     osUser
	template string // root directory whose data dir is the template cluster
}

var localState struct {
	mu   sync.Mutex
	done bool
	l    *local
	err  error
}

// errNoBinaries marks the failure to find local binaries, after which
// NewServer skips rather than fails.
var errNoBinaries = errors.New("no local PostgreSQL binaries")

// getLocal finds the programs and makes the template cluster, once per
// process.
func getLocal() (*local, error) {
	localState.mu.Lock()
	defer localState.mu.Unlock()
	if !localState.done {
		localState.l, localState.err = newLocal()
		localState.done = true
	}
	return localState.l, localState.err
}

func newLocal() (*local, error) {
	bin, err := findBinaries()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errNoBinaries, err)
	}
	return newLocalFrom(bin)
}

// newLocalFrom is newLocal with the programs found.
func newLocalFrom(bin binaries) (*local, error) {
	u, err := findOSUser()
	if err != nil {
		return nil, err
	}
	for _, dir := range staleDirs() {
		removeStale(dir)
	}
	l := &local{bin: bin, user: u}
	root, err := u.mkRoot()
	if err != nil {
		return nil, err
	}
	data := filepath.Join(root, dataDir)
	log := filepath.Join(root, logFile)
	cmd := exec.Command(bin.initdb, "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
	if err := l.run(cmd, root, log, 2*time.Minute); err != nil {
		tail := tailOf(log)
		_ = os.RemoveAll(root)
		return nil, fmt.Errorf("initdb as OS user %s failed: %v (the directory %s must be reachable by that user; PGTEST_TMPDIR chooses another)%s", u.name, err, baseDir(), tail)
	}
	if err := appendFile(filepath.Join(data, "postgresql.conf"), serverSettings); err != nil {
		_ = os.RemoveAll(root)
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(data, "pg_hba.conf"), []byte(hbaConf), 0o600); err != nil {
		_ = os.RemoveAll(root)
		return nil, err
	}
	l.template = root
	return l, nil
}

// removeTemplate removes the template cluster of this process.
func removeTemplate() error {
	localState.mu.Lock()
	defer localState.mu.Unlock()
	if localState.l == nil || localState.l.template == "" {
		return nil
	}
	err := os.RemoveAll(localState.l.template)
	localState.l.template = ""
	if err != nil {
		return errorf("remove template cluster: %w", err)
	}
	return nil
}

func appendFile(path, text string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(text)
	return errors.Join(err, f.Close())
}

// mkRoot makes a pgtest directory owned by the OS user, with its owner file
// and socket directory.
func (u osUser) mkRoot() (string, error) {
	root, err := os.MkdirTemp(baseDir(), dirPrefix)
	if err != nil {
		return "", err
	}
	err = os.WriteFile(filepath.Join(root, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644)
	if err == nil {
		err = os.Mkdir(filepath.Join(root, sockDir), 0o700)
	}
	if err == nil {
		err = u.chown(root)
	}
	if err == nil {
		err = u.chown(filepath.Join(root, sockDir))
	}
	if err != nil {
		_ = os.RemoveAll(root)
		return "", fmt.Errorf("make temporary directory: %w", err)
	}
	return root, nil
}

// command prepares cmd to run as the OS user in dir, with its output
// appended to logPath.
func (u osUser) command(cmd *exec.Cmd, dir, logPath string) (*os.File, error) {
	f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	cmd.Dir = dir
	cmd.Env = childEnv()
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: u.cred, Setpgid: true}
	return f, nil
}

// run runs a short-lived program to completion, killing it after timeout.
func (l *local) run(cmd *exec.Cmd, dir, logPath string, timeout time.Duration) error {
	f, err := l.user.command(cmd, dir, logPath)
	if err != nil {
		return err
	}
	p, err := startChild(cmd, syscall.SIGKILL)
	f.Close()
	if err != nil {
		return err
	}
	if !p.waitFor(timeout) {
		p.signal(syscall.SIGKILL)
		p.waitFor(killTimeout)
		return fmt.Errorf("%s did not finish within %v", filepath.Base(cmd.Path), timeout)
	}
	if p.err != nil {
		return fmt.Errorf("%s: %w", filepath.Base(cmd.Path), p.err)
	}
	return nil
}

// childEnv is the environment of the PostgreSQL programs: ours without the
// libpq and locale variables, which could redirect or alter them.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "PG") || strings.HasPrefix(kv, "LC_") || strings.HasPrefix(kv, "LANG") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "LC_ALL=C")
}

// child is a process started by startChild.
type child struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has exited and been reaped
	err  error         // result of cmd.Wait, set before done is closed
}

// startChild starts cmd with a parent-death signal. The kernel sends that
// signal when the thread that forked the child exits, not the process, so
// the fork happens on a goroutine locked to its OS thread that stays alive,
// blocked in cmd.Wait, for as long as the child lives; the thread then exits
// with the goroutine.
func startChild(cmd *exec.Cmd, deathSignal syscall.Signal) (*child, error) {
	setPdeathsig(cmd.SysProcAttr, deathSignal)
	c := &child{cmd: cmd, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with this goroutine
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		c.err = cmd.Wait()
		close(c.done)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return c, nil
}

// waitFor waits until the child exits or timeout passes, and reports whether
// it exited.
func (c *child) waitFor(timeout time.Duration) bool {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-c.done:
		return true
	case <-timer.C:
		return false
	}
}

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// signal sends sig to the child; it does nothing once the child was reaped.
func (c *child) signal(sig os.Signal) {
	_ = c.cmd.Process.Signal(sig)
}

// copyTree copies the directory src to dst, keeping modes and giving every
// entry to the OS user.
func (l *local) copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			if err := os.Mkdir(target, info.Mode().Perm()); err != nil {
				return err
			}
		case d.Type()&fs.ModeSymlink != 0:
			link, err := os.Readlink(path)
			if err != nil {
				return err
			}
			if err := os.Symlink(link, target); err != nil {
				return err
			}
		case d.Type().IsRegular():
			if err := copyFile(path, target, info.Mode().Perm()); err != nil {
				return err
			}
		default:
			return nil // sockets and the like are not part of a cluster
		}
		return l.user.chown(target)
	})
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	return errors.Join(err, out.Close())
}

// tailOf returns the last lines of a log file, formatted to append to an
// error message, or "" when there is nothing to show.
func tailOf(path string) string {
	const maxBytes, maxLines = 8 << 10, 30
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || fi.Size() == 0 {
		return ""
	}
	off := max(fi.Size()-maxBytes, 0)
	buf := make([]byte, fi.Size()-off)
	if _, err := f.ReadAt(buf, off); err != nil && err != io.EOF {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(buf), "\n"), "\n")
	if off > 0 && len(lines) > 1 {
		lines = lines[1:] // first line is probably cut
	}
	if len(lines) > maxLines {
		lines = lines[len(lines)-maxLines:]
	}
	return "\n--- last lines of " + path + " ---\n" + strings.Join(lines, "\n")
}

// memFSMinFree is the free space a memory file system needs for pgtest to
// put its clusters there.
const memFSMinFree = 2 << 30

// baseDir returns the directory that holds pgtest directories:
// PGTEST_TMPDIR if set, else a memory file system (/dev/shm) with at least
// memFSMinFree bytes free, else os.TempDir(). On a memory file system
// CREATE DATABASE, which creates some 300 files, and starting a server are
// an order of magnitude faster than on a disk.
func baseDir() string {
	if dir := os.Getenv("PGTEST_TMPDIR"); dir != "" {
		return dir
	}
	if dir := memoryTempDir(memFSMinFree); dir != "" {
		return dir
	}
	return os.TempDir()
}

// staleDirs returns the directories where earlier runs may have left pgtest
// directories.
func staleDirs() []string {
	dirs := []string{baseDir()}
	for _, dir := range []string{os.TempDir(), memoryTempDir(0)} {
		if dir != "" && !slices.Contains(dirs, dir) {
			dirs = append(dirs, dir)
		}
	}
	return dirs
}

// removeStale removes pgtest directories in tmp left by test binaries that
// died: those whose owner and postmaster are both gone. A directory without
// either file is removed only once it is older than staleAge, since its
// maker may be about to write them.
func removeStale(tmp string) {
	dirs, _ := filepath.Glob(filepath.Join(tmp, dirPrefix+"*"))
	for _, dir := range dirs {
		fi, err := os.Lstat(dir)
		if err != nil || !fi.IsDir() {
			continue
		}
		owner, ownerKnown := pidIn(filepath.Join(dir, ownerFile))
		pm, pmKnown := pidIn(filepath.Join(dir, dataDir, "postmaster.pid"))
		switch {
		case ownerKnown && alive(owner), pmKnown && alive(pm):
			continue
		case !ownerKnown && !pmKnown && time.Since(fi.ModTime()) < staleAge:
			continue
		}
		_ = os.RemoveAll(dir)
	}
}

// pidIn reads the process id on the first line of a file.
func pidIn(path string) (int, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	pid, err := strconv.Atoi(strings.TrimSpace(string(line)))
	if err != nil || pid <= 0 {
		return 0, false
	}
	return pid, true
}

// alive reports whether a process with this id exists.
func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
