package pgtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// FindServer reports every step it tried; a step that found nothing is
// absent, and one that found something broken is not.
func TestFindServerNamesEveryStep(t *testing.T) {
	t.Setenv("PGTEST_ENGINE_URL", "")
	for _, tc := range []struct {
		name      string
		container func() (string, func() error, error)
		absent    bool
		want      string
	}{
		{"nothing", func() (string, func() error, error) { return "", nil, Absent("no engine") }, true, "3. container: no engine"},
		{"broken container", func() (string, func() error, error) { return "", nil, errors.New("image pull failed") }, false, "3. container: image pull failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := FindServer(Sources{EnvVars: []string{"PGTEST_ENGINE_URL"}, BinDir: t.TempDir(), Container: tc.container})
			var none *NoServerError
			if !errors.As(err, &none) {
				t.Fatalf("error %v, want a *NoServerError", err)
			}
			if none.Absent() != tc.absent {
				t.Errorf("Absent() = %v, want %v", none.Absent(), tc.absent)
			}
			for _, want := range []string{"1. PGTEST_ENGINE_URL: not set", "2. local PostgreSQL binaries: configured folder", tc.want} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error lacks %q:\n%v", want, err)
				}
			}
		})
	}
}

// A connection string through a Proxy reaches the same database, in URL
// and in keyword/value form.
func TestProxyConnString(t *testing.T) {
	dsn := DB(t)
	p := NewProxy(t, dsn)
	conn := Conn(t, dsn)
	var want string
	if err := conn.QueryRow(context.Background(), "SELECT current_database()").Scan(&want); err != nil {
		t.Fatal(err)
	}
	cfg := conn.Config()
	kv := fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, cfg.Database)
	_, proxyPort, _ := strings.Cut(p.Addr(), ":")
	for _, s := range []string{dsn, kv} {
		via, err := p.ConnString(s)
		if err != nil {
			t.Fatal(err)
		}
		c := Conn(t, via)
		var got string
		if err := c.QueryRow(context.Background(), "SELECT current_database()").Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("through %q: database %s, want %s", via, got, want)
		}
		if fmt.Sprint(c.Config().Port) != proxyPort {
			t.Errorf("through %q: connected to port %d, not the proxy's %s", via, c.Config().Port, proxyPort)
		}
	}
}
