package pgtest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
)

// dockerPingTimeout bounds the check for a Docker engine, so that a machine
// without one fails over at once instead of waiting for testcontainers.
const dockerPingTimeout = 2 * time.Second

// defaultDockerImage is the image of the Docker backend; PGTEST_DOCKER_IMAGE
// overrides it.
const defaultDockerImage = "postgres:16-alpine"

// dockerBackend starts the shared server in a Docker container, if a Docker
// engine answers a ping within dockerPingTimeout.
func dockerBackend() (*backend, error) {
	if err := dockerPing(); err != nil {
		return nil, err
	}
	image := os.Getenv("PGTEST_DOCKER_IMAGE")
	if image == "" {
		image = defaultDockerImage
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ctr, err := tcpostgres.Run(ctx, image,
		testcontainers.WithCmd("postgres",
			"-c", "fsync=off",
			"-c", "full_page_writes=off",
			"-c", "max_connections=400",
			"-c", "shared_buffers=32MB",
			"-c", "autovacuum=off"),
		tcpostgres.BasicWaitStrategies())
	if err != nil {
		if ctr != nil {
			_ = testcontainers.TerminateContainer(ctr)
		}
		return nil, fmt.Errorf("start container %s: %w", image, err)
	}
	connString, err := ctr.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr)
		return nil, fmt.Errorf("container address: %w", err)
	}
	return &backend{
		admin: &admin{connString: connString},
		connString: func(db string) string {
			s, _ := withDBName(connString, db)
			return s
		},
		stop: func() error {
			if err := testcontainers.TerminateContainer(ctr); err != nil {
				return errorf("remove container: %w", err)
			}
			return nil
		},
	}, nil
}

// dockerPing sends GET /_ping to the engine at DOCKER_HOST, or at
// unix:///var/run/docker.sock, and fails unless it answers 200 within
// dockerPingTimeout.
func dockerPing() error {
	host := os.Getenv("DOCKER_HOST")
	if host == "" {
		host = "unix:///var/run/docker.sock"
	}
	u, err := url.Parse(host)
	if err != nil {
		return fmt.Errorf("DOCKER_HOST=%s: %w", host, err)
	}
	dialer := &net.Dialer{Timeout: dockerPingTimeout}
	transport := &http.Transport{DisableKeepAlives: true}
	base := "http://docker"
	switch u.Scheme {
	case "unix":
		path := u.Path
		transport.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, "unix", path)
		}
	case "tcp", "http", "https":
		transport.DialContext = dialer.DialContext
		base = "http://" + u.Host
		if u.Scheme == "https" || os.Getenv("DOCKER_TLS_VERIFY") != "" {
			cfg, err := dockerTLS()
			if err != nil {
				return fmt.Errorf("DOCKER_HOST=%s: %w", host, err)
			}
			transport.TLSClientConfig = cfg
			base = "https://" + u.Host
		}
	default:
		return fmt.Errorf("DOCKER_HOST=%s: scheme %q is not supported by the ping (use unix:// or tcp://)", host, u.Scheme)
	}
	client := &http.Client{Transport: transport, Timeout: dockerPingTimeout}
	defer transport.CloseIdleConnections()
	resp, err := client.Get(base + "/_ping")
	if err != nil {
		return fmt.Errorf("no Docker engine answered at %s within %v: %w", host, dockerPingTimeout, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<10))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("the Docker engine at %s answered the ping with %s", host, resp.Status)
	}
	return nil
}

// dockerTLS loads the client certificates that the docker CLI uses for a
// TLS-protected engine.
func dockerTLS() (*tls.Config, error) {
	dir := os.Getenv("DOCKER_CERT_PATH")
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return nil, err
		}
		dir = filepath.Join(home, ".docker")
	}
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem"))
	if err != nil {
		return nil, err
	}
	ca, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, errors.New("no certificate in " + filepath.Join(dir, "ca.pem"))
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12}, nil
}
