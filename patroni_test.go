//go:build patroni

package idempotency

// A failover run by Patroni, as production runs one: one etcd, two
// PostgreSQL nodes managed by Patroni with synchronous_mode, and two Caddy
// processes on a multi-host DSN with target_session_attrs=read-write.
// Under load (unique keys, each retried until a 2xx, and slow keys whose
// upstream call spans the failover, retried meanwhile by a second client),
// a planned `patronictl switchover` and a crash (kill -9 of the leader's
// postmaster and of its Patroni), at Patroni's default timings and at fast
// ones. `make failover-patroni` runs them all (build tag patroni); CI runs
// the fast crash. Debian: apt-get install patroni etcd-server.

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
)

// patroniTimings are the DCS settings of a run.
type patroniTimings struct {
	name                        string
	ttl, loopWait, retryTimeout int
}

var (
	patroniDefault = patroniTimings{"default", 30, 10, 10}
	patroniFast    = patroniTimings{"fast", 10, 2, 4}
)

// TestPatroniFailover runs the scenarios that IDEMPOTENCY_PATRONI names
// (comma-separated, of switchover-default, crash-default,
// switchover-fast, crash-fast; all of them if unset).
func TestPatroniFailover(t *testing.T) {
	scenarios := []struct {
		name   string
		crash  bool
		timing patroniTimings
	}{
		{"switchover-default", false, patroniDefault},
		{"crash-default", true, patroniDefault},
		{"switchover-fast", false, patroniFast},
		{"crash-fast", true, patroniFast},
	}
	want := os.Getenv("IDEMPOTENCY_PATRONI")
	ran := 0
	for _, sc := range scenarios {
		if want != "" && !strings.Contains(","+want+",", ","+sc.name+",") {
			continue
		}
		ran++
		t.Run(sc.name, func(t *testing.T) {
			c := startPatroni(t, sc.timing)
			runPatroniScenario(t, c, sc.name, sc.crash)
		})
	}
	if ran == 0 {
		t.Fatalf("IDEMPOTENCY_PATRONI=%q names no scenario", want)
	}
}

// patroniCluster is an etcd and two Patroni nodes on loopback.
type patroniCluster struct {
	dir                string
	asUser             []string
	etcdPort           int
	pgPorts, restPorts [2]int
	procs              [2]*exec.Cmd
	// exited[i] is closed once node i's Patroni has been waited for.
	exited [2]chan struct{}
	timing patroniTimings
}

func (c *patroniCluster) config(i int) string {
	return filepath.Join(c.dir, fmt.Sprintf("node%d.yml", i))
}

func (c *patroniCluster) DSN() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		c.pgPorts[0], c.pgPorts[1])
}

func (c *patroniCluster) nodeDSN(i int) string { return pgtest.PortDSN(c.pgPorts[i]) }

// startPatroni starts etcd and both nodes, and returns once one node leads
// and the other is its synchronous standby, streaming. It fails, saying
// what to install, without the binaries.
func startPatroni(t *testing.T, timing patroniTimings) *patroniCluster {
	t.Helper()
	for _, bin := range []string{"etcd", "patroni", "patronictl"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s not found: install Debian's patroni and etcd-server (apt-get install patroni etcd-server) to run the Patroni scenarios", bin)
		}
	}
	_, pgCtl, err := pgtest.FindBinaries()
	if err != nil {
		t.Fatalf("%v: install PostgreSQL's server binaries", err)
	}
	binDir := filepath.Dir(pgCtl)
	if real, err := filepath.EvalSymlinks(pgCtl); err == nil {
		binDir = filepath.Dir(real)
	}
	dir, err := os.MkdirTemp("", "idempotency-patroni-")
	if err != nil {
		t.Fatal(err)
	}
	c := &patroniCluster{dir: dir, timing: timing}
	if u := pgtest.ServerOwned(t, dir); u != nil {
		c.asUser = []string{"runuser", "-u", u.Username, "--"}
	}
	ports := make([]int, 6)
	for i := range ports {
		ports[i] = freeTCPPort(t)
	}
	c.etcdPort, c.pgPorts, c.restPorts = ports[0], [2]int{ports[2], ports[3]}, [2]int{ports[4], ports[5]}
	scope := "idem-" + pgtest.RandomHex(4)

	etcd := c.command(t, "etcd.log", "etcd", "--name", "e1", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", fmt.Sprintf("http://127.0.0.1:%d", c.etcdPort),
		"--advertise-client-urls", fmt.Sprintf("http://127.0.0.1:%d", c.etcdPort),
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		"--initial-cluster", fmt.Sprintf("e1=http://127.0.0.1:%d", ports[1]))
	if err := etcd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, p := range c.procs {
			if p != nil && p.Process != nil {
				_ = p.Process.Signal(syscall.SIGTERM)
			}
		}
		for i := range c.procs {
			c.waitNodeDown(i)
		}
		for i := range c.procs {
			// A postmaster whose Patroni was killed outlives it.
			_ = c.run(pgCtl, "-D", filepath.Join(dir, fmt.Sprintf("data%d", i)), "-m", "immediate", "-w", "stop")
		}
		_ = etcd.Process.Kill()
		_ = etcd.Wait()
		if t.Failed() {
			for _, f := range []string{"etcd.log", "patroni0.log", "patroni1.log"} {
				if out, err := os.ReadFile(filepath.Join(dir, f)); err == nil {
					if len(out) > 4000 {
						out = out[len(out)-4000:]
					}
					t.Logf("%s (tail):\n%s", f, out)
				}
			}
		}
		os.RemoveAll(dir)
	})

	for i := range 2 {
		cfg := fmt.Sprintf(`scope: %[1]s
name: node%[2]d
restapi:
  listen: 127.0.0.1:%[3]d
  connect_address: 127.0.0.1:%[3]d
etcd3:
  hosts: 127.0.0.1:%[4]d
bootstrap:
  dcs:
    ttl: %[5]d
    loop_wait: %[6]d
    retry_timeout: %[7]d
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    postgresql:
      use_pg_rewind: true
      parameters:
        synchronous_commit: "on"
        max_connections: 200
        wal_log_hints: "on"
  initdb:
  - encoding: UTF8
  - locale: C
  pg_hba:
  - host all all 127.0.0.1/32 trust
  - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:%[8]d
  connect_address: 127.0.0.1:%[8]d
  data_dir: %[9]s/data%[2]d
  bin_dir: %[10]s
  pgpass: %[9]s/pgpass%[2]d
  authentication:
    replication:
      username: postgres
    superuser:
      username: postgres
  parameters:
    unix_socket_directories: %[9]s
`, scope, i, c.restPorts[i], c.etcdPort, timing.ttl, timing.loopWait, timing.retryTimeout, c.pgPorts[i], dir, binDir)
		if err := os.WriteFile(c.config(i), []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		c.startNode(t, i)
		if i == 0 {
			storetest.WaitFor(t, 60*time.Second, "node0 to lead", func() bool { return c.leader() == 0 })
		}
	}
	storetest.WaitFor(t, 120*time.Second, "a leader and its synchronous standby, streaming", func() bool {
		m := c.members()
		return len(m) == 2 && c.leader() >= 0 && c.syncStandby() >= 0
	})
	return c
}

// command is name run as the server's user, its output to log in the
// cluster's directory.
func (c *patroniCluster) command(t *testing.T, log string, name string, args ...string) *exec.Cmd {
	t.Helper()
	out, err := os.OpenFile(filepath.Join(c.dir, log), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { out.Close() })
	all := append(append([]string{}, c.asUser...), name)
	all = append(all, args...)
	cmd := exec.Command(all[0], all[1:]...)
	cmd.Dir = c.dir
	cmd.Stdout, cmd.Stderr = out, out
	return cmd
}

func (c *patroniCluster) startNode(t *testing.T, i int) {
	t.Helper()
	c.procs[i] = c.command(t, fmt.Sprintf("patroni%d.log", i), "patroni", c.config(i))
	if err := c.procs[i].Start(); err != nil {
		t.Fatal(err)
	}
	p, exited := c.procs[i], make(chan struct{})
	c.exited[i] = exited
	go func() {
		_ = p.Wait()
		close(exited)
	}()
}

func (c *patroniCluster) waitNodeDown(i int) {
	if c.exited[i] == nil {
		return
	}
	select {
	case <-c.exited[i]:
	case <-time.After(30 * time.Second):
	}
}

func (c *patroniCluster) run(args ...string) error {
	all := append(append([]string{}, c.asUser...), args...)
	cmd := exec.Command(all[0], all[1:]...)
	cmd.Dir = c.dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %v\n%s", strings.Join(all, " "), err, out)
	}
	return nil
}

// patroniMember is a member as the REST API's /cluster lists it.
type patroniMember struct {
	Name  string `json:"name"`
	Role  string `json:"role"`
	State string `json:"state"`
}

// members asks either node's REST API for the cluster's members.
func (c *patroniCluster) members() []patroniMember {
	client := http.Client{Timeout: 2 * time.Second}
	for _, port := range c.restPorts {
		resp, err := client.Get(fmt.Sprintf("http://127.0.0.1:%d/cluster", port))
		if err != nil {
			continue
		}
		var body struct {
			Members []patroniMember `json:"members"`
		}
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err == nil {
			return body.Members
		}
	}
	return nil
}

func (c *patroniCluster) memberIndex(role string, states ...string) int {
	for _, m := range c.members() {
		if m.Role != role {
			continue
		}
		for _, s := range states {
			if m.State == s {
				n, _ := strconv.Atoi(strings.TrimPrefix(m.Name, "node"))
				return n
			}
		}
	}
	return -1
}

func (c *patroniCluster) leader() int { return c.memberIndex("leader", "running") }
func (c *patroniCluster) syncStandby() int {
	return c.memberIndex("sync_standby", "streaming", "running")
}

// crash kills node i's postmaster and its Patroni with SIGKILL.
func (c *patroniCluster) crash(t *testing.T, i int) {
	t.Helper()
	pidFile, err := os.ReadFile(filepath.Join(c.dir, fmt.Sprintf("data%d", i), "postmaster.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.SplitN(string(pidFile), "\n", 2)[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// The Patroni process itself: runuser's child when run as root.
	pids := []int{c.procs[i].Process.Pid}
	if len(c.asUser) > 0 {
		children, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pids[0], pids[0]))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range strings.Fields(string(children)) {
			child, _ := strconv.Atoi(f)
			pids = append([]int{child}, pids...)
		}
	}
	for _, p := range pids {
		if err := syscall.Kill(p, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
}

// switchover asks Patroni for a planned switchover from the leader.
func (c *patroniCluster) switchover(t *testing.T, from, to int) {
	t.Helper()
	if err := c.run("patronictl", "-c", c.config(from), "switchover", "--leader", fmt.Sprintf("node%d", from),
		"--candidate", fmt.Sprintf("node%d", to), "--force"); err != nil {
		t.Fatal(err)
	}
}

// runPatroniScenario runs the load, the switchover or the crash in its
// midst, and checks and prints the run's summary.
func runPatroniScenario(t *testing.T, c *patroniCluster, name string, crash bool) {
	r := &failoverRun{up: newUpstream(t), patience: 3 * time.Minute}
	for i := range r.procs {
		port := freeTCPPort(t)
		r.procs[i] = startCaddyProc(t, fmt.Sprintf("instance-%c", 'a'+i), fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
		}
		retry_after 1s
		prune_interval 0
	}
	reverse_proxy %s
}
`, port, c.DSN(), r.up.Addr()))
		r.sites[i] = procSite(t, r.procs[i], port)
		// A request in flight at a crash at the default timings waits
		// for the new leader, about 30 s, to store its response.
		r.sites[i].client.Timeout = r.patience
	}
	leader, standby := c.leader(), c.syncStandby()
	if leader < 0 || standby < 0 {
		t.Fatalf("no leader and synchronous standby: %+v", c.members())
	}

	var (
		next        atomic.Int64
		stop        atomic.Bool
		mu          sync.Mutex
		wg          sync.WaitGroup
		seq         = pgtest.RandomHex(3)
		ctx, cancel = context.WithTimeout(context.Background(), 10*time.Minute)
		slow        []*failoverKey
	)
	defer cancel()
	for i := range 8 {
		slow = append(slow, &failoverKey{key: fmt.Sprintf("patroni-slow-%s-%02d", seq, i), body: payBody(),
			header: map[string]string{"X-Test-Sleep": "2s"}})
	}
	r.keys = append(r.keys, slow...)
	r.start = time.Now()
	for range 8 {
		wg.Go(func() {
			for !stop.Load() {
				i := next.Add(1)
				k := &failoverKey{key: fmt.Sprintf("patroni-%s-%06d", seq, i), body: payBody(),
					header: map[string]string{"X-Test-Sleep": fmt.Sprintf("%dms", rand.IntN(30))}}
				mu.Lock()
				r.keys = append(r.keys, k)
				mu.Unlock()
				k.attempts = r.send(ctx, k, int(i%2))
			}
		})
	}
	event := make(chan struct{})
	for i, k := range slow {
		wg.Go(func() {
			time.Sleep(1500 * time.Millisecond)
			k.attempts = r.send(ctx, k, i%2)
		})
		wg.Go(func() {
			<-event
			time.Sleep(500 * time.Millisecond)
			k.retries = r.send(ctx, &failoverKey{key: k.key, body: k.body, header: k.header}, 1-i%2)
		})
	}
	time.Sleep(2 * time.Second)
	r.kill = time.Now()
	close(event)
	if crash {
		c.crash(t, leader)
	} else {
		c.switchover(t, leader, standby)
	}
	storetest.WaitFor(t, 3*time.Minute, "the standby to lead", func() bool { return c.leader() == standby })
	r.promoted = time.Now()
	// Load until some 2xx after the new leader, then a few seconds more.
	time.Sleep(5 * time.Second)
	stop.Store(true)
	wg.Wait()
	r.end = time.Now()

	// Every key once more, to the instance that did not answer it.
	keys := make(chan *failoverKey)
	for range 8 {
		wg.Go(func() {
			for k := range keys {
				k.again = r.send(ctx, k, 1-k.answeredBy)
			}
		})
	}
	for _, k := range r.keys {
		keys <- k
	}
	close(keys)
	wg.Wait()
	table := make(map[string]string)
	for _, row := range pgtest.Query(t, c.nodeDSN(standby), "SELECT key, status FROM idempotency_keys") {
		table[row[0]] = row[1]
	}

	executions := make(map[string]int)
	for _, e := range r.up.Executions() {
		executions[e.Key]++
	}
	var twice, lost, unanswered, againExecuted, bad int
	var firstOK time.Time
	var examples []string
	example := func(format string, args ...any) {
		if len(examples) < 20 {
			examples = append(examples, fmt.Sprintf(format, args...))
		}
	}
	for _, k := range r.keys {
		all := append(append(append([]failoverAttempt{}, k.attempts...), k.retries...), k.again...)
		if executions[k.key] > 1 {
			twice++
			example("%s: executed %d times", k.key, executions[k.key])
		}
		if len(k.attempts) == 0 || !k.attempts[len(k.attempts)-1].ok() {
			unanswered++
			example("%s: no 2xx", k.key)
		} else if table[k.key] != string(store.StatusCompleted) {
			lost++
			example("%s: answered 2xx, record %q on the new leader", k.key, table[k.key])
		}
		if n := len(k.again); n == 0 || !k.again[n-1].replayed {
			againExecuted++
			example("%s: sent again, not replayed", k.key)
		}
		for _, a := range all {
			switch {
			case a.ok():
				// A replay may come from an instance's cache: the first
				// execution tells that the new leader serves.
				if !a.replayed && !a.sent.Before(r.kill) && (firstOK.IsZero() || a.recv.Before(firstOK)) {
					firstOK = a.recv
				}
			case a.err == nil && a.status == http.StatusServiceUnavailable && a.problem == "store-unavailable" && a.retryAfter,
				a.err == nil && a.status == http.StatusConflict:
			default:
				bad++
				example("%s: %d %q (Retry-After %v) %v", k.key, a.status, a.problem, a.retryAfter, a.err)
			}
		}
	}
	recovery := -1.0
	if !firstOK.IsZero() {
		recovery = firstOK.Sub(r.kill).Seconds()
	}
	line := fmt.Sprintf("%s: %d keys, %d executed twice, %d lost, recovery %.1f s", name, len(r.keys), twice, lost, recovery)
	fmt.Println(line)
	t.Logf("%s (new leader after %.1f s; %d keys without a 2xx, %d not replayed when sent again, %d answers other than 2xx, 503 + Retry-After or 409)",
		line, r.promoted.Sub(r.kill).Seconds(), unanswered, againExecuted, bad)
	if len(examples) > 0 {
		t.Logf("notable keys:\n%s", strings.Join(examples, "\n"))
	}
	if twice > 0 || lost > 0 || unanswered > 0 || againExecuted > 0 || bad > 0 || firstOK.IsZero() {
		t.Errorf("%s: want 0 executed twice, 0 lost, every key answered and replayed, only 503 + Retry-After or 409 in the gap", line)
	}
}
