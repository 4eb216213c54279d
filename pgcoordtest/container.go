package pgcoordtest

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/moby/moby/client"
	"github.com/pgcoord/pgcoord/internal/pgtest"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/postgres"
)

// dockerPingTimeout bounds the question whether a Docker engine answers;
// without one the container step gives up after it, never hanging.
const dockerPingTimeout = 2 * time.Second

// containerTimeout bounds pulling the image and starting the container.
const containerTimeout = 5 * time.Minute

// sources is where DB looks for a server under cfg.
func sources(cfg serverConfig) pgtest.Sources {
	src := pgtest.Sources{
		EnvVars: []string{EnvDatabaseURL, EnvProjectDatabaseURL},
		BinDir:  cfg.binDir,
	}
	if cfg.container {
		src.Container = func() (string, func() error, error) { return startContainer(cfg.image) }
	}
	return src
}

// findServer finds or starts a server under cfg. The container step runs
// only when the steps before it found nothing at all: a step that found
// something broken (binaries that do not start) ends the search with its
// error, which a container would otherwise hide.
func findServer(cfg serverConfig) (*pgtest.Found, error) {
	src := sources(cfg)
	container := src.Container
	src.Container = nil
	found, err := pgtest.FindServer(src)
	var none *pgtest.NoServerError
	if err == nil || container == nil || !errors.As(err, &none) || !none.Absent() {
		return found, err
	}
	// Nothing to use so far: the local step again, which finds nothing
	// again at once, then the container.
	found, err = pgtest.FindServer(pgtest.Sources{BinDir: src.BinDir, Container: container})
	var more *pgtest.NoServerError
	if errors.As(err, &more) {
		// The variables' attempt, then the local and container ones.
		attempts := append(none.Attempts[:len(none.Attempts)-1:len(none.Attempts)-1], more.Attempts...)
		return nil, &pgtest.NoServerError{Attempts: attempts}
	}
	return found, err
}

// pingDocker reports whether a Docker engine answers testcontainers-go
// within dockerPingTimeout. Its error wraps pgtest.ErrAbsent when none
// does.
func pingDocker() error {
	ctx, cancel := context.WithTimeout(context.Background(), dockerPingTimeout)
	defer cancel()
	done := make(chan error, 1) // the goroutine never blocks on it
	go func() {
		defer func() {
			// testcontainers-go panics in some setups without a engine.
			if r := recover(); r != nil {
				done <- fmt.Errorf("%v", r)
			}
		}()
		cli, err := testcontainers.NewDockerClientWithOpts(ctx)
		if err != nil {
			done <- err
			return
		}
		defer cli.Close()
		_, err = cli.Ping(ctx, client.PingOptions{})
		done <- err
	}()
	var err error
	select {
	case err = <-done:
	case <-time.After(dockerPingTimeout + 100*time.Millisecond):
		err = errors.New("no answer")
	}
	if err != nil {
		return pgtest.Absent("no Docker engine answered within %v: %v", dockerPingTimeout, err)
	}
	return nil
}

// startContainer starts a PostgreSQL container from image through
// testcontainers-go's postgres module, once a Docker engine answers. It
// returns the superuser's connection string and a function that removes
// the container; testcontainers-go's reaper removes it too when the test
// binary exits without calling that.
func startContainer(image string) (string, func() error, error) {
	if err := pingDocker(); err != nil {
		return "", nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), containerTimeout)
	defer cancel()
	ctr, err := postgres.Run(ctx, image,
		postgres.WithDatabase("postgres"),
		postgres.WithUsername("postgres"),
		postgres.WithPassword("pgcoordtest"),
		postgres.BasicWaitStrategies(),
	)
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr)
		return "", nil, fmt.Errorf("start container %s: %w", image, err)
	}
	connString, err := ctr.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr)
		return "", nil, fmt.Errorf("container %s: %w", image, err)
	}
	return connString, func() error { return testcontainers.TerminateContainer(ctr) }, nil
}
