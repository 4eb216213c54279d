package pgtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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

	"github.com/jackc/pgx/v5"
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

// clusterMember is a member as Patroni's GET /cluster describes it.
type clusterMember struct {
	Name  string `json:"name"`
	Role  string `json:"role"` // leader, sync_standby, replica
	State string `json:"state"`
}

// members asks the nodes' REST APIs, in turn, for the cluster's members.
func (c *PatroniCluster) members(ctx context.Context) ([]clusterMember, error) {
	var errs []error
	for _, n := range c.nodes {
		var out struct {
			Members []clusterMember `json:"members"`
		}
		err := c.getJSON(ctx, n.apiURL()+"/cluster", &out)
		if err == nil {
			return out.Members, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", n.name, err))
	}
	return nil, errors.Join(errs...)
}

func (n *patroniNode) apiURL() string { return "http://127.0.0.1:" + strconv.Itoa(n.apiPort) }

// Primary returns the name of the node that Patroni records as the leader
// and whose PostgreSQL answers as a primary (not in recovery). It returns
// an error when there is none at the moment, or ctx ends.
func (c *PatroniCluster) Primary(ctx context.Context) (string, error) {
	ms, err := c.members(ctx)
	if err != nil {
		return "", err
	}
	for _, m := range ms {
		if m.Role != "leader" {
			continue
		}
		inRecovery, err := c.inRecovery(ctx, m.Name)
		if err != nil {
			return "", fmt.Errorf("leader %s: %w", m.Name, err)
		}
		if inRecovery {
			return "", fmt.Errorf("leader %s is still in recovery", m.Name)
		}
		return m.Name, nil
	}
	return "", fmt.Errorf("no leader among %+v", ms)
}

// inRecovery connects to the node and asks pg_is_in_recovery().
func (c *PatroniCluster) inRecovery(ctx context.Context, name string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, haHTTPTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.NodeConnString(name, "postgres"))
	if err != nil {
		return false, err
	}
	defer closeConn(conn)
	var r bool
	err = conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&r)
	return r, err
}

// waitPrimary polls until there is a primary, and returns its name.
func (c *PatroniCluster) waitPrimary(ctx context.Context) (string, error) {
	for pause := 10 * time.Millisecond; ; pause = min(2*pause, 250*time.Millisecond) {
		name, err := c.Primary(ctx)
		if err == nil {
			return name, nil
		}
		if err := c.checkRunning(); err != nil {
			return "", err
		}
		if err := sleepCtx(ctx, pause); err != nil {
			return "", fmt.Errorf("no primary: %w (last: %v)", err, name)
		}
	}
}

// checkRunning reports an error when etcd or a started Patroni has exited.
func (c *PatroniCluster) checkRunning() error {
	if c.etcd != nil && c.etcd.exited() {
		return fmt.Errorf("etcd exited: %v", c.etcd.err)
	}
	for _, n := range c.nodes {
		if n.proc != nil && n.proc.exited() {
			return fmt.Errorf("patroni %s exited: %v", n.name, n.proc.err)
		}
	}
	return nil
}

// Health is the replication state of the cluster at one moment.
type Health struct {
	Primary   string   // the node that leads, "" when none does
	Sync      []string // nodes that Patroni lists as synchronous standbys
	Streaming []string // nodes that stream from the primary as synchronous standbys, by its pg_stat_replication
}

// Health reads the cluster's state from Patroni and from the primary's
// pg_stat_replication.
func (c *PatroniCluster) Health(ctx context.Context) (Health, error) {
	var h Health
	ms, err := c.members(ctx)
	if err != nil {
		return h, err
	}
	for _, m := range ms {
		switch m.Role {
		case "leader":
			h.Primary = m.Name
		case "sync_standby":
			h.Sync = append(h.Sync, m.Name)
		}
	}
	if h.Primary == "" {
		return h, nil
	}
	ctx, cancel := context.WithTimeout(ctx, haHTTPTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.NodeConnString(h.Primary, "postgres"))
	if err != nil {
		return h, err
	}
	defer closeConn(conn)
	rows, err := conn.Query(ctx, "SELECT application_name FROM pg_stat_replication WHERE state = 'streaming' AND sync_state IN ('sync', 'quorum') ORDER BY 1")
	if err != nil {
		return h, err
	}
	h.Streaming, err = pgx.CollectRows(rows, pgx.RowTo[string])
	return h, err
}

// healthy reports whether the primary has every other node streaming as a
// synchronous standby, and Patroni lists them as such.
func (h Health) healthy() bool {
	return h.Primary != "" && len(h.Sync) == haNodes-1 && len(h.Streaming) == haNodes-1
}

// WaitHealthy waits until one node is the primary and both others stream
// from it as synchronous standbys, by Patroni and by the primary's
// pg_stat_replication. It returns an error when ctx ends first (with the
// last state seen) or when a process of the cluster exited.
func (c *PatroniCluster) WaitHealthy(ctx context.Context) error {
	var last Health
	var lastErr error
	for pause := 10 * time.Millisecond; ; pause = min(2*pause, 250*time.Millisecond) {
		last, lastErr = c.Health(ctx)
		if lastErr == nil && last.healthy() {
			return nil
		}
		if err := c.checkRunning(); err != nil {
			return err
		}
		if err := sleepCtx(ctx, pause); err != nil {
			return fmt.Errorf("cluster not healthy: %w (last state %+v, error %v)", err, last, lastErr)
		}
	}
}

// Switchover asks Patroni for a planned switchover from the current primary
// to the node called to, through the primary's REST API (POST /switchover
// with leader and candidate). It first waits until the cluster is healthy
// (WaitHealthy), and returns once to's PostgreSQL answers as the primary
// and Patroni reports the switchover done, with the moments the request
// was sent and to was first seen answering as the primary (asked every
// 2 ms, on one connection, while Patroni works). ctx bounds all of it.
func (c *PatroniCluster) Switchover(ctx context.Context, to string) (sent, answering time.Time, err error) {
	if c.node(to) == nil {
		return sent, answering, fmt.Errorf("switchover: no node %q", to)
	}
	if err := c.WaitHealthy(ctx); err != nil {
		return sent, answering, fmt.Errorf("switchover to %s: %w", to, err)
	}
	from, err := c.Primary(ctx)
	if err != nil {
		return sent, answering, fmt.Errorf("switchover to %s: %w", to, err)
	}
	if from == to {
		return sent, answering, fmt.Errorf("switchover: %s is the primary already", to)
	}
	body, _ := json.Marshal(map[string]string{"leader": from, "candidate": to})
	type reply struct {
		code int
		text string
		err  error
	}
	done := make(chan reply, 1)
	sent = time.Now()
	go func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.node(from).apiURL()+"/switchover", bytes.NewReader(body))
		if err != nil {
			done <- reply{err: err}
			return
		}
		req.Header.Set("Content-Type", "application/json")
		// Patroni answers once the leader key has moved, polling every
		// second for up to 20 s.
		resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
		if err != nil {
			done <- reply{err: err}
			return
		}
		defer resp.Body.Close()
		text, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		done <- reply{code: resp.StatusCode, text: strings.TrimSpace(string(text))}
	}()
	// One connection to the candidate, opened before the request, sees
	// its promotion: a standby's promotion keeps its connections.
	probe := &recoveryProbe{connString: c.NodeConnString(to, "postgres")}
	defer probe.close()
	var r *reply
	for answering.IsZero() || r == nil {
		if answering.IsZero() {
			if inRecovery, err := probe.inRecovery(ctx); err == nil && !inRecovery {
				answering = time.Now()
			}
		}
		select {
		case got := <-done:
			if got.err != nil || got.code != http.StatusOK {
				return sent, answering, fmt.Errorf("switchover from %s to %s: %d %q %v", from, to, got.code, got.text, got.err)
			}
			r = &got
		default:
		}
		if answering.IsZero() || r == nil {
			if err := sleepCtx(ctx, 2*time.Millisecond); err != nil {
				return sent, answering, fmt.Errorf("switchover from %s to %s: %w (Patroni answered: %v; %s answering as the primary since %v)", from, to, err, r, to, answering)
			}
		}
	}
	return sent, answering, nil
}

// recoveryProbe asks one server, over one connection that it opens again
// when it fails, whether it is in recovery.
type recoveryProbe struct {
	connString string
	conn       *pgx.Conn
}

func (p *recoveryProbe) inRecovery(ctx context.Context) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, haHTTPTimeout)
	defer cancel()
	if p.conn == nil {
		conn, err := pgx.Connect(ctx, p.connString)
		if err != nil {
			return false, err
		}
		p.conn = conn
	}
	var r bool
	if err := p.conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&r); err != nil {
		p.close()
		return false, err
	}
	return r, nil
}

func (p *recoveryProbe) close() {
	if p.conn != nil {
		closeConn(p.conn)
		p.conn = nil
	}
}

// getJSON GETs url and decodes its JSON body into out.
func (c *PatroniCluster) getJSON(ctx context.Context, url string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return json.Unmarshal(b, out)
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
