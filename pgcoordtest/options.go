package pgcoordtest

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// Option configures DB (and Client, which calls it through its database).
// Invalid or conflicting options fail the test with a clear message;
// none is silently replaced by a default.
//
// WithBinDir, WithoutContainer and WithContainerImage choose the test
// binary's one server, so they act on the first call that needs a server;
// a later call that passes different ones fails, naming the server that is
// already in use.
type Option interface {
	apply(*config) error
}

type optionFunc struct {
	name string
	f    func(*config) error
}

func (o optionFunc) apply(c *config) error {
	if err := o.f(c); err != nil {
		return fmt.Errorf("pgcoordtest: option %s: %w", o.name, err)
	}
	return nil
}

// config is what the options of one call set.
type config struct {
	server serverConfig
	fail   bool // fail, not skip, when no server can be found
	set    map[string]bool
}

// serverConfig is what chooses the test binary's server.
type serverConfig struct {
	binDir    string
	container bool
	image     string
}

// DefaultContainerImage is the image of the container step unless
// WithContainerImage says otherwise.
const DefaultContainerImage = "postgres:17-alpine"

func newConfig(opts []Option) (*config, error) {
	c := &config{
		server: serverConfig{
			binDir:    os.Getenv(EnvBinDir),
			container: true,
			image:     DefaultContainerImage,
		},
		set: map[string]bool{},
	}
	var errs []error
	for _, o := range opts {
		if o == nil {
			errs = append(errs, errors.New("pgcoordtest: nil Option"))
			continue
		}
		errs = append(errs, o.apply(c))
	}
	if c.set["WithoutContainer"] && c.set["WithContainerImage"] {
		errs = append(errs, errors.New("pgcoordtest: WithoutContainer and WithContainerImage conflict"))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return c, nil
}

// once records that option name was given, and refuses it twice.
func (c *config) once(name string) error {
	if c.set[name] {
		return errors.New("given more than once")
	}
	c.set[name] = true
	return nil
}

// WithBinDir names the folder holding PostgreSQL's initdb, postgres and
// pg_ctl, for when the server binaries are neither on PATH nor in a usual
// location; it overrides PGCOORDTEST_PG_BINDIR. dir must be an absolute
// path. The server is started from there only when no database URL
// variable is set.
func WithBinDir(dir string) Option {
	return optionFunc{"WithBinDir", func(c *config) error {
		if err := c.once("WithBinDir"); err != nil {
			return err
		}
		if !strings.HasPrefix(dir, "/") {
			return fmt.Errorf("dir must be an absolute path, got %q", dir)
		}
		c.server.binDir = dir
		return nil
	}}
}

// WithoutContainer leaves out the container step: when no database URL is
// set and no local binaries are found, the test skips (or fails) without
// asking Docker.
func WithoutContainer() Option {
	return optionFunc{"WithoutContainer", func(c *config) error {
		if err := c.once("WithoutContainer"); err != nil {
			return err
		}
		c.server.container = false
		return nil
	}}
}

// WithContainerImage sets the image of the container step (default
// [DefaultContainerImage]); it must be a PostgreSQL 13 or later image that
// takes the official image's POSTGRES_* variables.
func WithContainerImage(image string) Option {
	return optionFunc{"WithContainerImage", func(c *config) error {
		if err := c.once("WithContainerImage"); err != nil {
			return err
		}
		if image == "" {
			return errors.New("image is empty")
		}
		c.server.image = image
		return nil
	}}
}

// FailIfUnavailable makes DB fail the test, instead of skipping it, when
// no server can be found at all. Under CI=true DB always fails then, so
// that a CI run never passes a test that did not run.
func FailIfUnavailable() Option {
	return optionFunc{"FailIfUnavailable", func(c *config) error {
		if err := c.once("FailIfUnavailable"); err != nil {
			return err
		}
		c.fail = true
		return nil
	}}
}
