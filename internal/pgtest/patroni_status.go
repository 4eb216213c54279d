package pgtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// What a running Patroni cluster reports, and how a test drives it: which
// node is the primary (by its REST API and pg_is_in_recovery), whether
// every member is healthy, and a planned switchover to another node.

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
