// Package throwaway starts a short-lived PostgreSQL server from the local
// binaries, for example programs that should run with no configuration.
//
// The server lives in a fresh directory from os.MkdirTemp, listens on a free
// TCP port on 127.0.0.1 with trust authentication, and runs as a foreground
// child. On Linux the kernel stops it (SIGQUIT, PostgreSQL's immediate
// shutdown) if the program dies without calling stop; the directory is then
// left behind. When the program runs as root (Linux), initdb and postgres run
// as the OS user "postgres", since they refuse to run as root. The server is
// tuned for speed, not durability (fsync=off).
package throwaway

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// startTimeout bounds initdb plus the server's start, on top of ctx.
const startTimeout = 60 * time.Second

// stopTimeout is how long stop waits for a fast shutdown before killing.
const stopTimeout = 10 * time.Second

// Start initialises a new cluster in a temporary directory and starts
// PostgreSQL on it. It returns a connection string for the "postgres" database
// as the superuser "postgres" (TCP, sslmode=disable) and a stop function that
// shuts the server down and removes the directory; stop is safe to call more
// than once and from several goroutines.
//
// ctx bounds the start only (initdb and waiting until the server accepts
// connections), never the server's life. The binaries are looked up in PATH
// and then in /usr/lib/postgresql/*/bin (highest version first). Start returns
// an error naming what it tried when no binaries are found, and the server's
// log when it does not start.
func Start(ctx context.Context) (connString string, stop func(), err error) {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()

	bin, err := findBinDir()
	if err != nil {
		return "", nil, err
	}
	who, err := serverUser()
	if err != nil {
		return "", nil, err
	}

	dir, err := os.MkdirTemp("", "pgcoord-example-")
	if err != nil {
		return "", nil, fmt.Errorf("throwaway: %w", err)
	}
	removeDir := func() { _ = os.RemoveAll(dir) }
	if err := who.chown(dir); err != nil {
		removeDir()
		return "", nil, fmt.Errorf("throwaway: %w", err)
	}
	data := filepath.Join(dir, "data")

	var initOut bytes.Buffer
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"),
		"-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-locale", "--no-sync")
	initdb.Dir = dir
	initdb.Stdout, initdb.Stderr = &initOut, &initOut
	initdb.SysProcAttr = who.procAttr(syscall.SIGKILL)
	if err := initdb.Run(); err != nil {
		removeDir()
		return "", nil, fmt.Errorf("throwaway: initdb: %w\n%s", err, initOut.String())
	}

	// A port from the kernel can be taken by someone else before the server
	// binds it; try a few.
	var lastErr error
	for range 3 {
		port, err := freePort()
		if err != nil {
			removeDir()
			return "", nil, err
		}
		stop, err := startServer(ctx, bin, dir, data, port, who)
		if err == nil {
			connString = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
			return connString, func() { stop(); removeDir() }, nil
		}
		lastErr = err
		if ctx.Err() != nil {
			break
		}
	}
	removeDir()
	return "", nil, lastErr
}

// startServer runs postgres in the foreground and waits until it accepts
// connections. The returned stop shuts it down (fast shutdown, then kill).
func startServer(ctx context.Context, bin, dir, data string, port int, who osUser) (stop func(), err error) {
	logPath := filepath.Join(dir, "server.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("throwaway: %w", err)
	}
	defer logFile.Close() // the child keeps its own descriptor

	cmd := exec.Command(filepath.Join(bin, "postgres"),
		"-D", data,
		"-p", strconv.Itoa(port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories="+dir,
		"-c", "max_connections=100",
		"-c", "fsync=off",
		"-c", "synchronous_commit=off",
		"-c", "full_page_writes=off",
	)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// If this program dies, the kernel sends the postmaster SIGQUIT
	// (immediate shutdown), which also stops its backends (Linux only).
	cmd.SysProcAttr = who.procAttr(syscall.SIGQUIT)
	// The parent-death signal comes when the thread that started the child
	// exits, so start it from a locked thread that lives exactly as long as
	// the goroutine waiting for the child.
	started := make(chan error, 1)
	exited := make(chan struct{})
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		_ = cmd.Wait()
		close(exited)
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("throwaway: start postgres: %w", err)
	}

	var once sync.Once
	stop = func() {
		once.Do(func() {
			_ = cmd.Process.Signal(syscall.SIGINT) // fast shutdown
			select {
			case <-exited:
			case <-time.After(stopTimeout):
				_ = cmd.Process.Kill()
				<-exited
			}
		})
	}

	connString := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=postgres sslmode=disable connect_timeout=2", port)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		c, err := pgconn.Connect(ctx, connString)
		if err == nil {
			_ = c.Close(ctx)
			return stop, nil
		}
		select {
		case <-exited:
			return nil, fmt.Errorf("throwaway: postgres exited during start:\n%s", readLog(logPath))
		case <-ctx.Done():
			stop()
			return nil, fmt.Errorf("throwaway: postgres did not accept connections: %w (last error: %v)\n%s", ctx.Err(), err, readLog(logPath))
		case <-tick.C:
		}
	}
}

// findBinDir returns the directory that holds initdb and postgres.
func findBinDir() (string, error) {
	tried := []string{"PATH"}
	if p, err := exec.LookPath("initdb"); err == nil {
		dir := filepath.Dir(p)
		if _, err := os.Stat(filepath.Join(dir, "postgres")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	// Highest major version first.
	slices.SortFunc(dirs, func(a, b string) int {
		va, _ := strconv.Atoi(filepath.Base(filepath.Dir(a)))
		vb, _ := strconv.Atoi(filepath.Base(filepath.Dir(b)))
		return vb - va
	})
	for _, d := range dirs {
		_, err1 := os.Stat(filepath.Join(d, "initdb"))
		_, err2 := os.Stat(filepath.Join(d, "postgres"))
		if err1 == nil && err2 == nil {
			return d, nil
		}
	}
	tried = append(tried, "/usr/lib/postgresql/*/bin")
	return "", fmt.Errorf("throwaway: no PostgreSQL binaries (initdb and postgres) found in %s; install PostgreSQL or set DATABASE_URL", strings.Join(tried, ", "))
}

// freePort asks the kernel for a free TCP port on 127.0.0.1.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("throwaway: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// readLog returns the end of the server log, for error messages.
func readLog(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(no server log: " + err.Error() + ")"
	}
	const max = 4000
	if len(b) > max {
		b = b[len(b)-max:]
	}
	return string(b)
}

// DatabaseURL returns $DATABASE_URL when it is set, with a stop function
// that does nothing. Otherwise it says so on standard output, starts a
// throwaway server with Start, and returns its connection string and stop.
// ctx bounds the start only.
func DatabaseURL(ctx context.Context) (string, func(), error) {
	if dsn := os.Getenv("DATABASE_URL"); dsn != "" {
		return dsn, func() {}, nil
	}
	fmt.Println("DATABASE_URL is not set: starting a throwaway PostgreSQL from the local binaries ...")
	return Start(ctx)
}
