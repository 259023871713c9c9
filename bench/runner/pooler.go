package main

// Rows 2b and 3b: rows 2 and 3 with the store's DSN through PgBouncer in
// pool_mode = transaction, as production often runs it, and with pgx's
// default_query_exec_mode = cache_describe, which a transaction pooler
// needs (README, "Behind a connection pooler"): no statement is
// prepared on a server connection, so the server parses and plans every
// statement, and each goes through one more process. The pooler gets
// as many server connections as the store's pool holds at most, so that
// what differs from rows 2 and 3 is the pooler itself, not a pool
// smaller than the store's.

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// pooler is a PgBouncer process in front of the benchmark's database.
type pooler struct {
	cmd    *exec.Cmd
	dir    string
	exited chan struct{}
	// dsn is the benchmark's database through the pooler, for the store.
	dsn string
}

// findPgBouncer returns the PgBouncer binary that rows 2b and 3b use:
// the one named, or the one on PATH or where Debian installs it
// (/usr/sbin is not on every user's PATH). "off" names none.
func findPgBouncer(named string) (string, error) {
	switch named {
	case "off":
		return "", fmt.Errorf("-pgbouncer off")
	case "":
	default:
		return exec.LookPath(named)
	}
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/sbin/pgbouncer"); err == nil {
		return "/usr/sbin/pgbouncer", nil
	}
	return "", fmt.Errorf("pgbouncer is not installed (Debian: apt-get install pgbouncer), or name it with -pgbouncer")
}

// poolSize is the most connections the store's pool holds by default
// (defaultMaxConns in postgres.go), as many as the pooler gets.
func poolSize() int { return max(16, 4*runtime.GOMAXPROCS(0)) }

// startPooler starts bin in transaction mode on a free port, in front of
// the server and database of the benchmark's DSN. PgBouncer refuses to
// run as root: then it runs as the postgres user, in a directory of
// that user's.
func (b *bench) startPooler(bin string) (*pooler, error) {
	upstream, err := pgconn.ParseConfig(b.cfg.dsn)
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idempotency-bench-pgbouncer-")
	if err != nil {
		return nil, err
	}
	p := &pooler{dir: dir, exited: make(chan struct{})}
	fail := func(err error) (*pooler, error) {
		os.RemoveAll(dir)
		return nil, err
	}
	// The clients are trusted, as on the benchmark's loopback; the
	// server is logged into with the DSN's password, if it has one.
	ini := fmt.Sprintf(`[databases]
%[1]s = host=%[2]s port=%[3]d dbname=%[1]s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %[4]d
unix_socket_dir =
auth_type = trust
auth_file = %[5]s/users.txt
pool_mode = transaction
default_pool_size = %[6]d
max_client_conn = 1000
logfile = %[5]s/pgbouncer.log
pidfile = %[5]s/pgbouncer.pid
`, upstream.Database, upstream.Host, upstream.Port, port, dir, poolSize())
	users := strconv.Quote(upstream.User) + " " + strconv.Quote(upstream.Password) + "\n"
	if err := os.WriteFile(filepath.Join(dir, "pgbouncer.ini"), []byte(ini), 0o600); err != nil {
		return fail(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "users.txt"), []byte(users), 0o600); err != nil {
		return fail(err)
	}
	p.cmd = exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	p.cmd.Dir = dir
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return fail(fmt.Errorf("pgbouncer refuses to run as root, and there is no postgres user to run it as: %v", err))
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		for _, f := range []string{dir, filepath.Join(dir, "pgbouncer.ini"), filepath.Join(dir, "users.txt")} {
			if err := os.Chown(f, uid, gid); err != nil {
				return fail(err)
			}
		}
		p.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	}
	out, err := os.Create(filepath.Join(b.logs, "pgbouncer.out"))
	if err != nil {
		return fail(err)
	}
	p.cmd.Stdout, p.cmd.Stderr = out, out
	if err := p.cmd.Start(); err != nil {
		out.Close()
		return fail(fmt.Errorf("starting %s: %v", bin, err))
	}
	go func() { _ = p.cmd.Wait(); out.Close(); close(p.exited) }()
	b.sampler.track(p.cmd.Process.Pid, "pooler")

	// The application_name lets the CPU sampler find the server
	// connections, which PgBouncer gives the client's.
	u := url.URL{Scheme: "postgres", Host: fmt.Sprintf("127.0.0.1:%d", port), Path: "/" + upstream.Database}
	if upstream.Password != "" {
		u.User = url.UserPassword(upstream.User, upstream.Password)
	} else {
		u.User = url.User(upstream.User)
	}
	u.RawQuery = url.Values{"sslmode": {"disable"}, "default_query_exec_mode": {"cache_describe"},
		"application_name": {"idempotency-bench"}}.Encode()
	p.dsn = u.String()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		select {
		case <-p.exited:
			log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
			os.RemoveAll(dir)
			return nil, fmt.Errorf("pgbouncer exited at start:\n%s", lastLines(string(log), 20))
		default:
		}
		conn, err := pgx.Connect(ctx, p.dsn)
		if err == nil {
			_, err = conn.Exec(ctx, "SELECT 1")
			conn.Close(ctx)
		}
		if err == nil {
			return p, nil
		}
		if ctx.Err() != nil {
			p.stop(b.logs)
			return nil, fmt.Errorf("pgbouncer on port %d does not answer: %v", port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop ends PgBouncer at once (SIGINT), and keeps its log in logs, with
// the run's.
func (p *pooler) stop(logs string) {
	_ = p.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-p.exited:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
	if log, err := os.ReadFile(filepath.Join(p.dir, "pgbouncer.log")); err == nil {
		_ = os.WriteFile(filepath.Join(logs, "pgbouncer.log"), log, 0o644)
	}
	os.RemoveAll(p.dir)
}
