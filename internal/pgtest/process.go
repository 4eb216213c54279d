package pgtest

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Process is a child process of a test, typically the test binary itself
// run again in a helper mode, that a test talks to line by line: it writes
// commands to the child's standard input and reads the child's standard
// output as lines. The child gets SIGKILL when the test binary dies, and in
// t.Cleanup (after SIGCONT, in case it was stopped); its standard error is
// logged when the test failed.
type Process struct {
	c     *child
	stdin io.WriteCloser
	lines chan string // closed at the end of standard output

	mu     sync.Mutex
	stderr bytes.Buffer
}

// processTimeout bounds the wait for a killed child to be reaped.
const processTimeout = 30 * time.Second

// StartProcess starts cmd, whose Stdin, Stdout and Stderr must be unset,
// and stops it in t.Cleanup. It calls t.Fatal when cmd cannot start.
func StartProcess(t testing.TB, cmd *exec.Cmd) *Process {
	t.Helper()
	p := &Process{lines: make(chan string, 1024)}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(errorf("process: %w", err))
	}
	// A pipe of our own: cmd.Wait would close StdoutPipe's at exit, maybe
	// before the last lines are read.
	stdout, w, err := os.Pipe()
	if err != nil {
		t.Fatal(errorf("process: %w", err))
	}
	cmd.Stdout = w
	cmd.Stderr = lockedWriter{&p.mu, &p.stderr}
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	p.stdin = stdin
	c, err := startChild(cmd, syscall.SIGKILL)
	w.Close()
	if err != nil {
		stdout.Close()
		t.Fatal(errorf("process: start %s: %w", cmd.Path, err))
	}
	p.c = c
	go func() {
		defer close(p.lines)
		defer stdout.Close()
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		p.Signal(syscall.SIGCONT)
		p.Signal(syscall.SIGKILL)
		if !p.c.waitFor(processTimeout) {
			t.Errorf("pgcoord: pgtest: process %d did not exit within %v of SIGKILL", p.Pid(), processTimeout)
		}
		for range p.lines { // let the reader finish
		}
		if t.Failed() {
			if s := p.Stderr(); s != "" {
				t.Logf("standard error of process %d:\n%s", p.Pid(), s)
			}
		}
	})
	return p
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (w lockedWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.w.Write(b)
}

// Pid returns the child's process id.
func (p *Process) Pid() int { return p.c.cmd.Process.Pid }

// Lines returns the child's standard output, line by line without the
// newline; the channel is closed when the child closes its output.
func (p *Process) Lines() <-chan string { return p.lines }

// Send writes line and a newline to the child's standard input. It calls
// t.Fatal when the write fails.
func (p *Process) Send(t testing.TB, line string) {
	t.Helper()
	if _, err := io.WriteString(p.stdin, line+"\n"); err != nil {
		t.Fatal(errorf("process %d: send %q: %w", p.Pid(), line, err))
	}
}

// Signal sends sig to the child; it does nothing once the child was reaped.
func (p *Process) Signal(sig syscall.Signal) { p.c.signal(sig) }

// Kill sends SIGKILL to the child and waits until it has been reaped, so
// that the kernel has closed every socket it had. It calls t.Fatal when the
// child is not reaped within 30 seconds.
func (p *Process) Kill(t testing.TB) {
	t.Helper()
	p.c.signal(syscall.SIGKILL)
	if !p.c.waitFor(processTimeout) {
		t.Fatal(errorf("process %d did not exit within %v of SIGKILL", p.Pid(), processTimeout))
	}
}

// Exited returns a channel that is closed when the child has exited and
// been reaped.
func (p *Process) Exited() <-chan struct{} { return p.c.done }

// ExitErr returns how the child exited (nil for status 0, an
// *exec.ExitError otherwise) once Exited is closed, and nil before.
func (p *Process) ExitErr() error {
	select {
	case <-p.c.done:
		return p.c.err
	default:
		return nil
	}
}

// Stderr returns what the child wrote to its standard error so far.
func (p *Process) Stderr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.TrimSpace(p.stderr.String())
}
