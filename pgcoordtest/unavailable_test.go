package pgcoordtest

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// The search for a server runs once per process, and testcontainers-go
// decides once per process where Docker is, so each case of these tests
// runs in a child process: the test binary again, which TestMain runs in
// helperEnv's mode (unavailableHelper), with the environment of the case.
const helperEnv = "PGCOORDTEST_UNAVAILABLE_HELPER"

// outcome is what the helper reports: how DB ended the test and how long
// the search took.
type outcome struct {
	Skipped, Failed bool
	Message         string
	Elapsed         time.Duration
}

// recordingT is the part of testing.TB that unavailable uses; it records
// whether the test was skipped or failed, and with what.
type recordingT struct {
	testing.TB
	skipped, failed bool
	msg             string
}

func (r *recordingT) Helper() {}
func (r *recordingT) Skip(args ...any) {
	r.skipped, r.msg = true, fmt.Sprint(args...)
	runtime.Goexit()
}
func (r *recordingT) Fatalf(format string, args ...any) {
	r.failed, r.msg = true, fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// unavailableHelper is the child's side, run by TestMain: it searches
// for a server with no local binaries (an empty bin folder), or in mode
// "broken" with binaries that fail, and prints how DB would end the test.
// It returns the exit code.
func unavailableHelper(mode string) int {
	dir, err := os.MkdirTemp("", "pgcoordtest-nobin-")
	if err != nil {
		fmt.Println(err)
		return 1
	}
	defer os.RemoveAll(dir)
	if mode == "broken" {
		// Server programs that are there and do not work.
		for _, name := range []string{"initdb", "postgres", "pg_ctl"} {
			if err := os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\necho broken >&2\nexit 1\n"), 0o755); err != nil {
				fmt.Println(err)
				return 1
			}
		}
		if err := os.Chmod(dir, 0o755); err != nil {
			fmt.Println(err)
			return 1
		}
	}
	cfg := serverConfig{binDir: dir, container: true, image: DefaultContainerImage}
	start := time.Now()
	_, err = newServer(cfg)
	o := outcome{Elapsed: time.Since(start)}
	if err == nil {
		fmt.Println("found a server where none should be")
		return 1
	}
	r := &recordingT{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		unavailable(r, err, mode == "fail")
	}()
	<-done
	o.Skipped, o.Failed, o.Message = r.skipped, r.failed, r.msg
	b, _ := json.Marshal(o)
	fmt.Printf("OUTCOME %s\n", b)
	return 0
}

// runUnavailable runs the helper with env added to a clean environment
// (no database URL, no CI) and returns its outcome.
func runUnavailable(t *testing.T, mode string, env ...string) outcome {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0])
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case EnvDatabaseURL, EnvProjectDatabaseURL, EnvBinDir, "CI", "DOCKER_HOST", helperEnv:
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, append([]string{helperEnv + "=" + mode}, env...)...)
	out, err := cmd.CombinedOutput()
	for _, line := range strings.Split(string(out), "\n") {
		if s, ok := strings.CutPrefix(line, "OUTCOME "); ok {
			var o outcome
			if err := json.Unmarshal([]byte(s), &o); err != nil {
				t.Fatalf("helper's outcome %q: %v", s, err)
			}
			return o
		}
	}
	t.Fatalf("helper reported no outcome (%v):\n%s", err, out)
	return outcome{}
}

// noDocker is a DOCKER_HOST where no engine listens.
const noDocker = "DOCKER_HOST=unix:///nonexistent/docker.sock"

// With no database URL, no local binaries and no Docker engine, DB skips
// the test with a message that names what it tried, why each failed, and
// how to provide each of the three.
func TestUnavailableSkipsNamingEveryWay(t *testing.T) {
	o := runUnavailable(t, "skip", noDocker)
	if !o.Skipped || o.Failed {
		t.Fatalf("skipped %v, failed %v; want a skip:\n%s", o.Skipped, o.Failed, o.Message)
	}
	for _, want := range []string{
		"1. " + EnvDatabaseURL + ", " + EnvProjectDatabaseURL + ": not set",
		"2. local PostgreSQL binaries: configured folder",
		"3. container: no Docker engine answered within 2s",
		"set " + EnvDatabaseURL + " (or " + EnvProjectDatabaseURL + ")",
		"apt-get install postgresql", "brew install postgresql@17", EnvBinDir, "WithBinDir",
		"Docker engine", "DOCKER_HOST", DefaultContainerImage,
	} {
		if !strings.Contains(o.Message, want) {
			t.Errorf("message lacks %q:\n%s", want, o.Message)
		}
	}
}

// FailIfUnavailable, and CI=true, turn that skip into a failure with the
// same message and the reason it fails.
func TestUnavailableFailsByOptionOrUnderCI(t *testing.T) {
	for _, tc := range []struct {
		name, mode string
		env        []string
		why        string
	}{
		{"FailIfUnavailable", "fail", nil, "FailIfUnavailable: failing instead of skipping"},
		{"CI=true", "skip", []string{"CI=true"}, "CI=true: a test that cannot run fails instead of skipping"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := runUnavailable(t, tc.mode, append(tc.env, noDocker)...)
			if !o.Failed || o.Skipped {
				t.Fatalf("skipped %v, failed %v; want a failure:\n%s", o.Skipped, o.Failed, o.Message)
			}
			for _, want := range []string{tc.why, "apt-get install postgresql", EnvDatabaseURL, "DOCKER_HOST"} {
				if !strings.Contains(o.Message, want) {
					t.Errorf("message lacks %q:\n%s", want, o.Message)
				}
			}
		})
	}
}

// A database URL that is set but cannot be used fails the test, even
// without FailIfUnavailable: something is configured, and broken.
func TestUnusableDatabaseURLFails(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	o := runUnavailable(t, "skip", EnvDatabaseURL+"=postgres://postgres@"+addr+"/postgres?sslmode=disable&connect_timeout=5", noDocker)
	if !o.Failed || o.Skipped {
		t.Fatalf("skipped %v, failed %v; want a failure:\n%s", o.Skipped, o.Failed, o.Message)
	}
	if !strings.Contains(o.Message, EnvDatabaseURL+" is set but unusable") {
		t.Errorf("message does not name the variable:\n%s", o.Message)
	}
}

// The question whether Docker answers is bounded: an engine address that
// accepts connections and never answers costs about 2 s, then the test
// skips saying so.
func TestDockerPingIsBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		var held []net.Conn // accepted, never answered
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	o := runUnavailable(t, "skip", "DOCKER_HOST=tcp://"+ln.Addr().String())
	if !o.Skipped {
		t.Fatalf("skipped %v, failed %v; want a skip:\n%s", o.Skipped, o.Failed, o.Message)
	}
	if !strings.Contains(o.Message, "no Docker engine answered within 2s") {
		t.Errorf("message does not say Docker did not answer:\n%s", o.Message)
	}
	if o.Elapsed > dockerPingTimeout+time.Second {
		t.Errorf("the search took %v with a silent Docker engine; want at most %v", o.Elapsed, dockerPingTimeout+time.Second)
	}
	t.Logf("search with a silent Docker engine: %v", o.Elapsed)
}

func (r *recordingT) Fatal(args ...any) {
	r.failed, r.msg = true, fmt.Sprint(args...)
	runtime.Goexit()
}

// Local server binaries that are there but do not start fail the test at
// once, without asking Docker: a container would hide that the configured
// binaries are broken. A Docker address that counts its connections shows
// whether the container step ran.
func TestBrokenBinariesFailWithoutAskingDocker(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var asked atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			asked.Add(1)
			c.Close()
		}
	}()
	o := runUnavailable(t, "broken", "DOCKER_HOST=tcp://"+ln.Addr().String())
	if !o.Failed || o.Skipped {
		t.Fatalf("skipped %v, failed %v; want a failure:\n%s", o.Skipped, o.Failed, o.Message)
	}
	if !strings.Contains(o.Message, "initdb") {
		t.Errorf("message does not say that initdb failed:\n%s", o.Message)
	}
	if n := asked.Load(); n != 0 || strings.Contains(o.Message, "container") {
		t.Errorf("the search asked Docker (%d connections) after the local binaries failed:\n%s", n, o.Message)
	}
}
