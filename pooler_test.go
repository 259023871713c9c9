package idempotency

// The Postgres store behind a transaction pooler, as production often
// runs it: Debian's PgBouncer in pool_mode = transaction in front of the
// test database, with fewer server connections than its clients hold, so
// that consecutive statements of one client land on different server
// connections and any session state the store kept would be lost or
// stranded.

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// pgBouncer is a PgBouncer process in front of the test database.
type pgBouncer struct {
	Port int
	dir  string
	cmd  *exec.Cmd
	// db and user are the test database's, which the pooler's DSNs name.
	db, user string
}

// findPgBouncer looks on PATH and where Debian installs it (/usr/sbin is
// not on every user's PATH).
func findPgBouncer() (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/sbin/pgbouncer"); err == nil {
		return "/usr/sbin/pgbouncer", nil
	}
	return "", fmt.Errorf("pgbouncer is not installed (Debian: apt-get install -y pgbouncer; .ci/run installs it)")
}

// startPgBouncer starts PgBouncer in transaction mode, on a free port, in
// front of the server and database of the test DSN, with serverConns
// server connections, and stops it when the test ends. It refuses to run
// as root: then it runs as the postgres user (or nobody), in a directory
// of that user's.
func startPgBouncer(t testing.TB, serverConns int) *pgBouncer {
	t.Helper()
	bin, err := findPgBouncer()
	if err != nil {
		t.Fatal(err)
	}
	upstream, err := pgconn.ParseConfig(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "idempotency-pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	b := &pgBouncer{Port: freeTCPPort(t), dir: dir, db: upstream.Database, user: upstream.User}

	// Trust, as the test server has it: PgBouncer still wants the user
	// in its auth file.
	cfg := fmt.Sprintf(`[databases]
%[1]s = host=%[2]s port=%[3]d dbname=%[1]s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %[4]d
unix_socket_dir = %[5]s
auth_type = trust
auth_file = %[5]s/users.txt
admin_users = %[6]s
pool_mode = transaction
default_pool_size = %[7]d
max_client_conn = 500
logfile = %[5]s/pgbouncer.log
pidfile = %[5]s/pgbouncer.pid
`, b.db, upstream.Host, upstream.Port, b.Port, dir, b.user, serverConns)
	// PgBouncer 1.21 learnt to carry named prepared statements
	// (max_prepared_statements, on by default from 1.24): the pooler the
	// store must work behind is the one without, which older versions
	// refuse to be told about.
	if carriesPreparedStatements(t, bin) {
		cfg += "max_prepared_statements = 0\n"
	}
	if err := os.WriteFile(filepath.Join(dir, "pgbouncer.ini"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "users.txt"), []byte(strconv.Quote(b.user)+` ""`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	b.cmd = exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	b.cmd.Dir = dir
	if u := pgtest.ServerOwned(t, dir); u != nil {
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		b.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	}
	out, err := os.Create(filepath.Join(dir, "stderr.log"))
	if err != nil {
		t.Fatal(err)
	}
	b.cmd.Stdout, b.cmd.Stderr = out, out
	if err := b.cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", bin, err)
	}
	exited := make(chan struct{})
	go func() { _ = b.cmd.Wait(); out.Close(); close(exited) }()
	t.Cleanup(func() {
		_ = b.cmd.Process.Signal(syscall.SIGINT) // PgBouncer's immediate shutdown
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			_ = b.cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
			if len(log) > 4000 {
				log = log[len(log)-4000:]
			}
			t.Logf("pgbouncer log (tail):\n%s", log)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case <-exited:
			log, _ := os.ReadFile(filepath.Join(dir, "stderr.log"))
			t.Fatalf("pgbouncer exited at start:\n%s", log)
		default:
		}
		if err = pgtest.Ping(b.DSN("simple_protocol")); err == nil {
			return b
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgbouncer on port %d does not answer: %v", b.Port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// carriesPreparedStatements reports whether the PgBouncer at bin is 1.21
// or later, which has max_prepared_statements.
func carriesPreparedStatements(t testing.TB, bin string) bool {
	t.Helper()
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		t.Fatalf("%s --version: %v", bin, err)
	}
	var major, minor int
	if _, err := fmt.Sscanf(string(out), "PgBouncer %d.%d", &major, &minor); err != nil {
		t.Fatalf("%s --version printed %q: %v", bin, out, err)
	}
	return major > 1 || major == 1 && minor >= 21
}

// DSN is the test database through the pooler, with pgx's
// default_query_exec_mode set to mode, or left to pgx's default
// (cache_statement) for "".
func (b *pgBouncer) DSN(mode string) string {
	u := url.URL{Scheme: "postgres", User: url.User(b.user), Host: fmt.Sprintf("127.0.0.1:%d", b.Port), Path: "/" + b.db}
	q := url.Values{"sslmode": {"disable"}}
	if mode != "" {
		q.Set("default_query_exec_mode", mode)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// Two instances on one table, both through the pooler in the modes pgx
// offers for it (and waiting through a direct listen_dsn), and the CLI in
// the third: concurrent retries of many
// keys execute each once and replay it byte for byte, across a restart
// of one instance; both instances prune, round after round; the CLI
// prunes and inspects.
func TestPostgresBehindTransactionPooler(t *testing.T) {
	bouncer := startPgBouncer(t, 6)
	direct := pgtest.DSN(t)
	table := pgtest.FreshTable(t)
	up := newUpstream(t)

	siteBlock := func(port int, mode string) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
			listen_dsn %q
			table %s
		}
		lock_timeout 10s
		retry_after 1s
		prune_interval 1s
		wait 3s
	}
	reverse_proxy %s
}
`, port, bouncer.DSN(mode), direct, table, up.Addr())
	}
	modes := [2]string{"cache_describe", "exec"}
	var procs [2]*caddyProc
	var ports [2]int
	var sites [2]*site
	start := func(i int, name string) {
		procs[i] = startCaddyProc(t, name, siteBlock(ports[i], modes[i]))
		sites[i] = procSite(t, procs[i], ports[i])
	}
	for i := range procs {
		ports[i] = freeTCPPort(t)
		start(i, fmt.Sprintf("instance-%c", 'a'+i))
	}

	// Each key is sent by several clients at once to both instances; the
	// ones that find it in progress retry until they get the answer.
	keysRound := func(round string, n int) {
		t.Helper()
		const clients = 4
		type key struct {
			c       call
			answers [clients]reply
		}
		keys := make([]*key, n)
		var wg sync.WaitGroup
		for i := range keys {
			k := &key{c: call{Key: fmt.Sprintf("%s-%d-%s", round, i, pgtest.RandomHex(4)), Body: payBody()}}
			keys[i] = k
			for c := range clients {
				wg.Add(1)
				go func() {
					defer wg.Done()
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					defer cancel()
					for inst := c % 2; ; inst = 1 - inst {
						r, err := sites[inst].DoCtx(ctx, k.c)
						if err != nil {
							t.Errorf("%s: %v", k.c.Key, err)
							return
						}
						if r.Status != http.StatusConflict {
							k.answers[c] = r
							return
						}
						ctxSleep(ctx, 50*time.Millisecond)
					}
				}()
			}
		}
		wg.Wait()
		execs := make(map[string]int)
		for _, e := range up.Executions() {
			execs[e.Key]++
		}
		for _, k := range keys {
			if execs[k.c.Key] != 1 {
				t.Errorf("%s executed %d times, want once", k.c.Key, execs[k.c.Key])
				continue
			}
			var first *reply
			for i := range k.answers {
				if r := &k.answers[i]; r.Status == http.StatusCreated && !r.replayed() {
					if first != nil {
						t.Fatalf("%s: two executed answers", k.c.Key)
					}
					first = r
				}
			}
			if first == nil {
				t.Fatalf("%s: no executed answer among %v", k.c.Key, k.answers)
			}
			for i := range k.answers {
				if r := k.answers[i]; &k.answers[i] != first {
					wantReplayOf(t, r, *first)
				}
			}
		}
	}
	keysRound("first", 60)

	// The restarted instance migrates and prepares again on server
	// connections that already served it.
	procs[1].stop()
	start(1, "instance-b-restarted")
	keysRound("restarted", 60)

	// Pruning: each round stops one instance (SIGSTOP) so that the other
	// must prune the expired rows the round adds. A lock left held on a
	// server connection by either instance stops every later round.
	expire := func(n int) {
		pgtest.Exec(t, direct, `INSERT INTO `+pgtest.QuoteIdent(table)+` (credential_hash, key, fingerprint, method, path,
			status, created_at, expires_at, response_status, response_headers, response_body, replayable, response_size)
			SELECT $1, 'expired-' || g || '-' || $2, $1, 'POST', '/pay', 'completed', now() - interval '2 days',
				now() - interval '1 hour', 201, '{}', '', true, 0
			FROM generate_series(1, $3::int) g`, make([]byte, 32), pgtest.RandomHex(4), n)
	}
	expired := func() int {
		n, _ := strconv.Atoi(pgtest.Query(t, direct, `SELECT count(*) FROM `+pgtest.QuoteIdent(table)+` WHERE expires_at < now()`)[0][0])
		return n
	}
	tn, _ := postgres.ParseTable(table)
	pruneLockFree := func() bool {
		ctx, conn, done := pgtest.Open(t, direct)
		defer done()
		var free bool
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, "SELECT pg_try_advisory_xact_lock($1)", tn.PruneLockKey()).Scan(&free)
		})
		if err != nil {
			t.Fatal(err)
		}
		return free
	}
	pruned := [2]int{}
	for round := range 6 {
		running, paused := round%2, 1-round%2
		// Not while the paused one is in the middle of a prune: it would
		// hold the lock until it is resumed.
		for {
			if err := procs[paused].cmd.Process.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			if pruneLockFree() {
				break
			}
			_ = procs[paused].cmd.Process.Signal(syscall.SIGCONT)
			time.Sleep(100 * time.Millisecond)
		}
		before := procs[running].logMessages(t)["idempotency.prune"]
		expire(50)
		storetest.WaitFor(t, 10*time.Second, fmt.Sprintf("round %d: %s to prune", round, procs[running].Name), func() bool { return expired() == 0 })
		if err := procs[paused].cmd.Process.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		storetest.WaitFor(t, 5*time.Second, "the prune log line", func() bool {
			return procs[running].logMessages(t)["idempotency.prune"] > before
		})
		pruned[running]++
		// A lock that outlives its prune (a session lock, released on
		// another server connection than it was taken on) is held by a
		// pooled server connection, idle: whichever of the instances'
		// statements lands there can take it again, the others cannot.
		storetest.WaitFor(t, 5*time.Second, fmt.Sprintf("round %d: the prune lock to be free", round), pruneLockFree)
	}
	for i, p := range procs {
		if n := p.logMessages(t)["idempotency.store_error"]; n > 0 {
			t.Errorf("%s logged %d store errors", p.Name, n)
		}
		if pruned[i] != 3 {
			t.Errorf("%s pruned %d rounds, want 3", p.Name, pruned[i])
		}
	}

	// The CLI through the pooler, once the instances, which would prune
	// first, have stopped.
	c := call{Key: newKey(), Body: payBody(), Path: "/pay/inspected"}
	wantExecuted(t, sites[0].Do(t, c), http.StatusCreated)
	for _, p := range procs {
		p.stop()
	}
	env := []string{"IDEMPOTENCY_DSN=" + bouncer.DSN("simple_protocol")}
	expire(7)
	wantCLI(t, runCLI(t, env, "prune", "--table", table, "--batch", "3"), exitOK, "pruned 7 expired record(s)")
	wantCLI(t, runCLI(t, env, "inspect", "--table", table, "--key", c.Key, "--credential", defaultCred),
		exitOK, "status:           completed", "POST /pay/inspected")
}

// A handler that waits, on a DSN taken to be pooled and without a
// listen_dsn, does not start, and says why: its waiters would never be
// woken.
func TestPooledDSNWaitNeedsListenDSN(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "Caddyfile")
	site := func(store string) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			%s
		}
		wait 3s
	}
	respond 201
}
`, freeTCPPort(t), store)
	}
	validate := func(store string) cliResult {
		if err := os.WriteFile(cfg, []byte(site(store)), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(buildCaddy(t), "validate", "--config", cfg, "--adapter", "caddyfile")
		cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir)
		out, err := cmd.CombinedOutput()
		res := cliResult{stderr: string(out)}
		if exitErr, ok := err.(*exec.ExitError); ok {
			res.code = exitErr.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return res
	}
	pooled := "postgres://u@127.0.0.1:6432/db?default_query_exec_mode=exec"
	wantCLI(t, validate(fmt.Sprintf("dsn %q", pooled)), 1, "default_query_exec_mode=exec", "transaction pooler", "set listen_dsn")
	wantCLI(t, validate(fmt.Sprintf("dsn %q\n\t\t\tlisten_dsn %q", pooled, "postgres://u@127.0.0.1:5432/db")), 0)
	// A listen_dsn through the pooler would take its LISTEN to a shared
	// server connection, and wait would never wake early.
	wantCLI(t, validate(fmt.Sprintf("dsn %q\n\t\t\tlisten_dsn %q", pooled, pooled)), 1, "listen_dsn asks for default_query_exec_mode=exec", "transaction pooler")
	wantCLI(t, validate(fmt.Sprintf("dsn %q\n\t\t\tlisten_dsn %q", pooled, "postgres://u@127.0.0.1:6432/db")), 1, "listen_dsn names the host and port of dsn (127.0.0.1:6432)", "transaction pooler")
	// The same pooler under another name of the loopback, or as one host
	// of a multi-host DSN.
	wantCLI(t, validate(fmt.Sprintf("dsn %q\n\t\t\tlisten_dsn %q", pooled, "postgres://u@localhost:6432/db")), 1, "listen_dsn names the host and port of dsn (localhost:6432)")
	wantCLI(t, validate(fmt.Sprintf("dsn %q\n\t\t\tlisten_dsn %q", pooled, "postgres://u@0.0.0.0:6432/db")), 1, "listen_dsn names the host and port of dsn (0.0.0.0:6432)")
	wantCLI(t, validate(fmt.Sprintf("dsn %q\n\t\t\tlisten_dsn %q", "postgres://u@10.0.0.1:6432,[::1]:6432/db?default_query_exec_mode=exec", "host=127.0.0.1 port=6432 dbname=db")), 1, "listen_dsn names the host and port of dsn (127.0.0.1:6432)")
	wantCLI(t, validate(fmt.Sprintf("dsn %q\n\t\t\tlisten_dsn %q", pooled, "postgres://u@127.0.0.1:5433/db")), 0)
	// cache_statement, the default, is a direct connection.
	wantCLI(t, validate(`dsn "postgres://u@127.0.0.1:5432/db"`), 0)
}

// A store's start leaves no named statement on a server connection of a
// transaction pooler in pgx's default mode: through a pooler of one
// server connection, where a second store meets whatever the first left,
// both stores of one table start. Starting with named statements, the
// second would meet the first's "already exists" and never start.
func TestStartThroughPoolerInDefaultMode(t *testing.T) {
	bouncer := startPgBouncer(t, 1)
	table := pgtest.FreshTable(t)
	for range 2 {
		provisionTestStore(t, &postgres.Store{DSN: bouncer.DSN(""), Table: table, MaxConns: 2})
	}
}

// A DSN through a transaction pooler in pgx's default mode,
// cache_statement: pgx prepares each statement once per connection,
// under a name of its own, but the pooler gives that connection another
// server connection for its next transaction, where the statement is
// missing (26000) or another client's copy already is (42P05). Requests
// fail closed, as with any store error, and one line for the store,
// however many handlers share it and requests fail, names the setting
// that fixes it. Two sites share the store's pool here.
func TestPooledDSNInDefaultModeIsNamed(t *testing.T) {
	bouncer := startPgBouncer(t, 2)
	table := pgtest.FreshTable(t)
	up := newUpstream(t)
	ports := [2]int{freeTCPPort(t), freeTCPPort(t)}
	var sites string
	for _, port := range ports {
		sites += fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn %q
			table %s
			max_conns 8
		}
		prune_interval 0
	}
	reverse_proxy %s
}
`, port, bouncer.DSN(""), table, up.Addr())
	}
	srv := startCaddyfile(t, sites)
	clients := [2]*site{newSiteClient(t, srv, ports[0]), newSiteClient(t, srv, ports[1])}

	type sent struct {
		c   call
		r   reply
		err error
	}
	var (
		mu      sync.Mutex
		answers []sent
	)
	refused := func() int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, a := range answers {
			if a.r.Status == http.StatusServiceUnavailable {
				n++
			}
		}
		return n
	}
	// Both stores start: their start prepares no named statement, so
	// that one store's start leaves nothing on a server connection that
	// the other's meets. Then the requests' statements meet the errors.
	for i, c := range clients {
		storetest.WaitFor(t, 30*time.Second, fmt.Sprintf("a request to execute through the pooler on site %d", i), func() bool {
			r, err := c.DoCtx(context.Background(), call{Key: newKey(), Body: payBody()})
			return err == nil && r.Status == http.StatusCreated
		})
	}
	// Rounds of concurrent first executions, until enough have failed
	// that a line per failure, or per handler, would show.
	const wantRefused = 20
	for deadline := time.Now().Add(60 * time.Second); refused() < wantRefused && time.Now().Before(deadline); {
		var wg sync.WaitGroup
		for i := range 16 {
			wg.Go(func() {
				c := call{Key: newKey(), Body: payBody()}
				r, err := clients[i%2].DoCtx(context.Background(), c)
				mu.Lock()
				answers = append(answers, sent{c, r, err})
				mu.Unlock()
			})
		}
		wg.Wait()
	}
	if n := refused(); n < wantRefused {
		t.Fatalf("%d of %d requests were refused through the pooler in pgx's default mode, want at least %d", n, len(answers), wantRefused)
	}

	executed := make(map[string]int)
	for _, e := range up.Executions() {
		executed[e.Key]++
	}
	for _, a := range answers {
		switch {
		case a.err != nil:
			// A completion retried past the client's patience: pgx's
			// connections that fail to deallocate a statement the
			// pooler lost fail every statement until one succeeds.
			// The ledger below still says whether it ran twice.
			t.Logf("%s: %v", a.c.Key, a.err)
			if executed[a.c.Key] > 1 {
				t.Errorf("%s executed %d times", a.c.Key, executed[a.c.Key])
			}
		case a.r.Status == http.StatusServiceUnavailable:
			wantProblem(t, a.r, http.StatusServiceUnavailable)
			wantRetryAfter(t, a.r)
			if executed[a.c.Key] != 0 {
				t.Errorf("%s got 503, but the upstream executed it", a.c.Key)
			}
		case a.r.Status == http.StatusCreated && !a.r.replayed():
			if executed[a.c.Key] != 1 {
				t.Errorf("%s executed %d times", a.c.Key, executed[a.c.Key])
			}
		default:
			t.Errorf("%s: %s, want 201 or 503", a.c.Key, a.r)
		}
	}

	var named []map[string]any
	for _, l := range srv.moduleLogLines(t) {
		if l["msg"] == "idempotency.exec_mode" {
			named = append(named, l)
		}
	}
	if len(named) != 1 {
		t.Fatalf("%d idempotency.exec_mode lines after %d refusals, want 1: %v", len(named), refused(), named)
	}
	l := named[0]
	fix, _ := l["fix"].(string)
	if l["level"] != "error" || !strings.Contains(fix, "default_query_exec_mode=cache_describe") || !strings.Contains(fix, "Behind a connection pooler") {
		t.Errorf("the line that names the pooler's problem: %v", l)
	}
	if code := l["sqlstate"]; code != "42P05" && code != "26000" {
		t.Errorf("the line's sqlstate is %v, want 42P05 or 26000", code)
	}
	data, err := os.ReadFile(srv.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.Contains(line, `"msg":"idempotency.exec_mode"`) {
			t.Logf("%s", line)
		}
	}
}
