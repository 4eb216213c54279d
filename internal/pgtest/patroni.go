package pgtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// A Patroni cluster's layout: os.MkdirTemp(baseDir(), haDirPrefix+"*")
// holds the owner file, etcd's directory and one directory per node, whose
// data directory is the node's cluster.
const (
	haDirPrefix   = "pgtest-ha-"
	haScope       = "pgtest"
	haNodes       = 3
	patroniLog    = "patroni.log"
	etcdLog       = "etcd.log"
	pgLogDir      = "pglog"
	pgLogFile     = "postgresql.log"
	haStartBound  = 3 * time.Minute  // etcd up, a primary and two streaming synchronous standbys
	haHTTPTimeout = 10 * time.Second // one request to Patroni's REST API or to etcd
	haStopBound   = 30 * time.Second // every process of a node gone after SIGKILL
)

// PatroniCluster is a high-availability PostgreSQL cluster for one test:
// three nodes of PostgreSQL run by Patroni, with a single-node etcd as
// Patroni's configuration store, all on 127.0.0.1 on free ports, in a
// temporary directory removed when the test ends.
//
// The cluster runs in synchronous mode with two synchronous standbys
// (synchronous_mode, synchronous_node_count = 2): while both other nodes
// stream, a commit on the primary returns once both have it, so either may
// take over without losing a committed transaction, and a planned
// switchover (Switchover) may go to either. Patroni takes a standby that
// stops streaming (a former primary restarting as a standby) out of
// synchronous_standby_names until it streams again. Patroni's loop runs every second (loop_wait = 1); its
// leader key lives Patroni's default of 30 s (ttl), which only an
// unplanned failover waits out, so that a loaded machine does not make
// Patroni demote a primary on its own. Every node trusts every local
// connection, replication included, and has the superuser postgres.
//
// Patroni, etcd and PostgreSQL run as the OS user postgres (or
// PGTEST_OS_USER) when the test runs as root. etcd gets SIGKILL and Patroni
// SIGTERM (on which it stops its PostgreSQL) when the test binary dies;
// a later run removes what such a binary left. On a failure, Logs returns
// the last lines of every log.
type PatroniCluster struct {
	user     osUser
	bindir   string
	patroni  string
	root     string
	etcd     *child
	etcdPort int
	etcdDir  string
	nodes    []*patroniNode
	http     *http.Client

	closeOnce sync.Once
	closeErr  error
}

// patroniNode is one Patroni process and the PostgreSQL it runs.
type patroniNode struct {
	name    string
	dir     string // Patroni's working directory
	data    string // the cluster: postgres's working directory
	pgPort  int
	apiPort int
	proc    *child
}

// NewPatroniCluster starts etcd and three Patroni nodes, and returns once one
// node is the primary and the two others stream from it as synchronous
// standbys (within three minutes); the cluster is stopped and removed in
// t.Cleanup. When patroni or etcd is not installed, or the PostgreSQL
// binaries lack a tool Patroni runs, it skips t saying how to install them,
// or fails it under CI (see SkipOrFail). It calls t.Fatal when the cluster
// does not come up, with the last lines of its logs.
func NewPatroniCluster(t testing.TB) *PatroniCluster {
	t.Helper()
	tools, err := findHATools()
	if err != nil {
		SkipOrFail(t, "this test needs Patroni, etcd and PostgreSQL server binaries with pg_basebackup and pg_controldata "+
			"(Debian: apt-get install patroni etcd-server postgresql): %v", err)
	}
	u, err := findOSUser()
	if err != nil {
		t.Fatal(errorf("patroni: %w", err))
	}
	for _, dir := range staleDirs() {
		removeStaleHA(dir)
	}
	c := &PatroniCluster{user: u, bindir: tools.bindir, patroni: tools.patroni, http: &http.Client{Timeout: haHTTPTimeout}}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), haStartBound)
	defer cancel()
	if err := c.start(ctx, tools.etcd); err != nil {
		t.Fatalf("%v%s", errorf("patroni: %w", err), c.Logs())
	}
	return c
}

// haTools are the programs a PatroniCluster runs.
type haTools struct {
	patroni, etcd, bindir string
}

// findHATools finds patroni and etcd on PATH, and the
// directory of the PostgreSQL binaries, which must hold what Patroni runs.
func findHATools() (haTools, error) {
	var tools haTools
	var missing []string
	for _, p := range []struct {
		name string
		dst  *string
	}{{"patroni", &tools.patroni}, {"etcd", &tools.etcd}} {
		path, err := exec.LookPath(p.name)
		if err != nil {
			missing = append(missing, p.name+" not found on PATH")
			continue
		}
		*p.dst = path
	}
	bin, err := findBinaries()
	if err != nil {
		missing = append(missing, "PostgreSQL binaries "+err.Error())
	} else {
		dir := filepath.Dir(bin.postgres)
		if real, err := filepath.EvalSymlinks(bin.postgres); err == nil {
			dir = filepath.Dir(real)
		}
		for _, name := range []string{"pg_ctl", "initdb", "pg_basebackup", "pg_controldata"} {
			if err := isExecutable(filepath.Join(dir, name)); err != nil {
				missing = append(missing, err.Error()+" (Patroni runs it from the directory of postgres)")
			}
		}
		tools.bindir = dir
	}
	if len(missing) > 0 {
		return tools, errors.New(strings.Join(missing, "; "))
	}
	return tools, nil
}

// start starts etcd, then the nodes, and waits until the cluster is healthy.
func (c *PatroniCluster) start(ctx context.Context, etcdBin string) error {
	root, err := c.user.mkRoot()
	if err != nil {
		return err
	}
	// mkRoot names its directories for NewServer's sweep; this one has a
	// sweep of its own.
	c.root = filepath.Join(filepath.Dir(root), haDirPrefix+strings.TrimPrefix(filepath.Base(root), dirPrefix))
	if err := os.Rename(root, c.root); err != nil {
		_ = os.RemoveAll(root)
		c.root = ""
		return err
	}
	if err := c.startEtcd(ctx, etcdBin); err != nil {
		return err
	}
	for i := range haNodes {
		n := &patroniNode{name: "node" + strconv.Itoa(i)}
		n.dir = filepath.Join(c.root, n.name)
		n.data = filepath.Join(n.dir, dataDir)
		if n.pgPort, err = freePort(); err != nil {
			return err
		}
		if n.apiPort, err = freePort(); err != nil {
			return err
		}
		c.nodes = append(c.nodes, n)
	}
	for i, n := range c.nodes {
		if err := c.startNode(n); err != nil {
			return err
		}
		if i == 0 {
			// The first node bootstraps the cluster; the others clone it
			// once it leads, and would race it for the initialize key
			// otherwise.
			if _, err := c.waitPrimary(ctx); err != nil {
				return fmt.Errorf("first node: %w", err)
			}
		}
	}
	return c.WaitHealthy(ctx)
}

// startEtcd starts a single-node etcd on two free ports and waits until it
// reports itself healthy.
func (c *PatroniCluster) startEtcd(ctx context.Context, bin string) error {
	c.etcdDir = filepath.Join(c.root, "etcd")
	if err := os.Mkdir(c.etcdDir, 0o700); err != nil {
		return err
	}
	if err := c.user.chown(c.etcdDir); err != nil {
		return err
	}
	var err error
	if c.etcdPort, err = freePort(); err != nil {
		return err
	}
	peer, err := freePort()
	if err != nil {
		return err
	}
	client := "http://127.0.0.1:" + strconv.Itoa(c.etcdPort)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(peer)
	cmd := exec.Command(bin,
		"--name", "etcd0",
		"--data-dir", filepath.Join(c.etcdDir, "data"),
		"--listen-client-urls", client,
		"--advertise-client-urls", client,
		"--listen-peer-urls", peerURL,
		"--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "etcd0="+peerURL,
		"--initial-cluster-state", "new",
		"--initial-cluster-token", filepath.Base(c.root),
		"--log-level", "warn",
	)
	f, err := c.user.command(cmd, c.etcdDir, filepath.Join(c.etcdDir, etcdLog))
	if err != nil {
		return err
	}
	c.etcd, err = startChild(cmd, syscall.SIGKILL)
	f.Close()
	if err != nil {
		return fmt.Errorf("start etcd: %w", err)
	}
	for pause := 10 * time.Millisecond; ; pause = min(2*pause, 200*time.Millisecond) {
		if c.etcd.exited() {
			return fmt.Errorf("etcd exited: %v", c.etcd.err)
		}
		var health struct {
			Health string `json:"health"`
		}
		if err := c.getJSON(ctx, client+"/health", &health); err == nil && health.Health == "true" {
			return nil
		}
		if err := sleepCtx(ctx, pause); err != nil {
			return fmt.Errorf("etcd not healthy: %w", err)
		}
	}
}

// patroniConfig is a node's configuration file. Patroni reads YAML, of
// which JSON is a subset.
func (c *PatroniCluster) patroniConfig(n *patroniNode) ([]byte, error) {
	hba := []string{
		"local all all trust",
		"host all all 127.0.0.1/32 trust",
		"local replication all trust",
		"host replication all 127.0.0.1/32 trust",
	}
	cfg := map[string]any{
		"scope":     haScope,
		"namespace": "/" + filepath.Base(c.root) + "/",
		"name":      n.name,
		"log":       map[string]any{"level": "INFO"},
		"restapi": map[string]any{
			"listen":          "127.0.0.1:" + strconv.Itoa(n.apiPort),
			"connect_address": "127.0.0.1:" + strconv.Itoa(n.apiPort),
		},
		"etcd3": map[string]any{
			"hosts":    "127.0.0.1:" + strconv.Itoa(c.etcdPort),
			"protocol": "http",
		},
		"bootstrap": map[string]any{
			"dcs": map[string]any{
				"ttl":                     30,
				"loop_wait":               1,
				"retry_timeout":           10,
				"maximum_lag_on_failover": 1 << 20,
				"synchronous_mode":        true,
				"synchronous_node_count":  haNodes - 1,
				"postgresql": map[string]any{
					"use_pg_rewind": false,
					"use_slots":     true,
					"parameters": map[string]any{
						"max_connections":           200,
						"max_wal_senders":           10,
						"max_replication_slots":     10,
						"wal_level":                 "replica",
						"hot_standby":               "on",
						"wal_keep_size":             "128MB",
						"max_locks_per_transaction": 64,
					},
				},
			},
			"initdb": []any{map[string]any{"encoding": "UTF8"}, map[string]any{"locale": "C"}, map[string]any{"auth": "trust"}},
			"pg_hba": hba,
		},
		"postgresql": map[string]any{
			"listen":          "127.0.0.1:" + strconv.Itoa(n.pgPort),
			"connect_address": "127.0.0.1:" + strconv.Itoa(n.pgPort),
			"data_dir":        n.data,
			"bin_dir":         c.bindir,
			"pgpass":          filepath.Join(n.dir, "pgpass"),
			"authentication": map[string]any{
				"superuser":   map[string]any{"username": "postgres"},
				"replication": map[string]any{"username": "postgres"},
			},
			"pg_hba":                 hba,
			"create_replica_methods": []string{"basebackup"},
			"basebackup":             []any{map[string]any{"checkpoint": "fast"}},
			"parameters": map[string]any{
				"unix_socket_directories":    filepath.Join(n.dir, sockDir),
				"shared_buffers":             "32MB",
				"huge_pages":                 "off",
				"fsync":                      "off",
				"full_page_writes":           "off",
				"autovacuum":                 "off",
				"dynamic_shared_memory_type": "mmap",
				"logging_collector":          "on",
				"log_directory":              filepath.Join(n.dir, pgLogDir),
				"log_filename":               pgLogFile,
				"log_min_messages":           "warning",
				// A standby whose primary changed, or whose slot is not
				// there yet, connects again after this instead of 5 s.
				"wal_retrieve_retry_interval": "200ms",
			},
		},
	}
	return json.MarshalIndent(cfg, "", "  ")
}

// startNode writes a node's configuration and starts its Patroni.
func (c *PatroniCluster) startNode(n *patroniNode) error {
	for _, dir := range []string{n.dir, filepath.Join(n.dir, sockDir), filepath.Join(n.dir, pgLogDir)} {
		if err := os.Mkdir(dir, 0o700); err != nil {
			return err
		}
		if err := c.user.chown(dir); err != nil {
			return err
		}
	}
	cfg, err := c.patroniConfig(n)
	if err != nil {
		return err
	}
	path := filepath.Join(n.dir, "patroni.yml")
	if err := writeOwned(c.user, path, string(cfg)); err != nil {
		return err
	}
	cmd := exec.Command(c.patroni, path)
	f, err := c.user.command(cmd, n.dir, filepath.Join(n.dir, patroniLog))
	if err != nil {
		return err
	}
	cmd.Env = append(cmd.Env, "HOME="+n.dir, "PYTHONUNBUFFERED=1")
	// On SIGTERM Patroni stops its PostgreSQL before it exits.
	n.proc, err = startChild(cmd, syscall.SIGTERM)
	f.Close()
	if err != nil {
		return fmt.Errorf("start patroni %s as OS user %s: %w", n.name, c.user.name, err)
	}
	return nil
}

// ConnString returns a connection string for database dbname that lists the
// three nodes with target_session_attrs=read-write: a connection goes to
// whichever node is the primary.
func (c *PatroniCluster) ConnString(dbname string) string {
	hosts := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		hosts[i] = "127.0.0.1:" + strconv.Itoa(n.pgPort)
	}
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write", strings.Join(hosts, ","), dbname)
}

// NodeConnString returns a connection string for database dbname on the
// node called name alone, whatever its role.
func (c *PatroniCluster) NodeConnString(name, dbname string) string {
	n := c.node(name)
	if n == nil {
		return ""
	}
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", n.pgPort, dbname)
}

// Nodes returns the names of the nodes.
func (c *PatroniCluster) Nodes() []string {
	names := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		names[i] = n.name
	}
	return names
}

func (c *PatroniCluster) node(name string) *patroniNode {
	for _, n := range c.nodes {
		if n.name == name {
			return n
		}
	}
	return nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Logs returns the last lines of etcd's log and of every node's Patroni and
// PostgreSQL logs, to append to a failure message.
func (c *PatroniCluster) Logs() string {
	if c.root == "" {
		return ""
	}
	var b strings.Builder
	b.WriteString(tailOf(filepath.Join(c.etcdDir, etcdLog)))
	for _, n := range c.nodes {
		b.WriteString(tailOf(filepath.Join(n.dir, patroniLog)))
		b.WriteString(tailOf(filepath.Join(n.dir, pgLogDir, pgLogFile)))
	}
	return b.String()
}

// Close stops every process of the cluster at once (SIGKILL to Patroni,
// an immediate shutdown of every PostgreSQL, SIGKILL to etcd) and removes
// its directory. It is called in t.Cleanup, and may be called before.
func (c *PatroniCluster) Close() error {
	c.closeOnce.Do(func() { c.closeErr = c.close() })
	return c.closeErr
}

func (c *PatroniCluster) close() error {
	if c.root == "" {
		return nil
	}
	var errs []error
	for _, n := range c.nodes {
		if n.proc != nil {
			n.proc.signal(syscall.SIGKILL)
		}
		if pid, ok := pidIn(filepath.Join(n.data, "postmaster.pid")); ok {
			_ = syscall.Kill(pid, syscall.SIGQUIT)
		}
	}
	for _, n := range c.nodes {
		if n.proc != nil && !n.proc.waitFor(haStopBound) {
			errs = append(errs, errorf("patroni: %s did not exit within %v of SIGKILL", n.name, haStopBound))
		}
		// Patroni's children (pg_basebackup, a postgres starting) work
		// in its directory, the postmaster and its children in the data
		// directory.
		for _, dir := range []string{n.data, n.dir} {
			if err := waitClusterGone(dir); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if c.etcd != nil {
		c.etcd.signal(syscall.SIGKILL)
		if !c.etcd.waitFor(haStopBound) {
			errs = append(errs, errorf("patroni: etcd did not exit within %v of SIGKILL", haStopBound))
		}
	}
	if err := os.RemoveAll(c.root); err != nil {
		errs = append(errs, errorf("patroni: remove %s: %w", c.root, err))
	}
	return errors.Join(errs...)
}

// removeStaleHA removes the Patroni clusters in tmp left by test binaries
// that died: whatever still runs in them (a PostgreSQL whose Patroni was
// killed outlives it) is killed first.
func removeStaleHA(tmp string) {
	dirs, _ := filepath.Glob(filepath.Join(tmp, haDirPrefix+"*"))
	for _, dir := range dirs {
		fi, err := os.Lstat(dir)
		if err != nil || !fi.IsDir() {
			continue
		}
		owner, ok := pidIn(filepath.Join(dir, ownerFile))
		if ok && alive(owner) || !ok && time.Since(fi.ModTime()) < staleAge {
			continue
		}
		var work []string
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if e.IsDir() {
				work = append(work, filepath.Join(dir, e.Name()), filepath.Join(dir, e.Name(), dataDir))
			}
		}
		slices.Sort(work)
		for _, w := range work {
			pids, _ := clusterProcesses(w)
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		for _, w := range work {
			_ = waitClusterGone(w)
		}
		_ = os.RemoveAll(dir)
	}
}
