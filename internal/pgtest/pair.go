package pgtest

// A primary and a streaming standby of PostgreSQL, started by a test from
// the server binaries (as the throwaway cluster of go is), for the
// tests of a failover: stop the primary at once, promote the standby.

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/jackc/pgx/v5"
)

// Pair is a primary and its standby, each on a port of 127.0.0.1.
type Pair struct {
	PrimaryPort, StandbyPort int
	dir                      string
	pgCtl                    string
	asUser                   []string
	// primaryOpts are the primary's settings, for a restart.
	primaryOpts string
}

// StartPair starts a primary and a standby that streams from it. With
// synchronous, every commit waits for the standby to have flushed it
// (synchronous_standby_names = '*', synchronous_commit = on); otherwise
// the standby replicates asynchronously. It returns once the standby is
// streaming, and stops both servers when the test ends. Without the
// server binaries the test fails, saying what to install.
//
// A lag above zero puts the standby that far behind the primary: it
// streams through lagProxy.
func StartPair(t testing.TB, synchronous bool, lag time.Duration) *Pair {
	t.Helper()
	standbyNames := "''"
	if synchronous {
		standbyNames = "'*'"
	}
	c, basebackup := StartPrimaryAlone(t, standbyNames)
	if err := c.run(basebackup, "-h", "127.0.0.1", "-p", strconv.Itoa(c.PrimaryPort), "-U", "postgres",
		"-D", c.data("standby"), "-R", "-X", "stream", "-c", "fast", "--no-sync"); err != nil {
		t.Fatal(err)
	}
	// Promoted, the standby must not wait for a standby of its own that
	// does not exist, as a failover manager would see to.
	standbyOpts := "-c synchronous_standby_names=''"
	if lag > 0 {
		standbyOpts += fmt.Sprintf(" -c primary_conninfo='host=127.0.0.1 port=%d user=postgres'", lagProxy(t, c.PrimaryPort, lag))
	}
	if err := c.start("standby", c.StandbyPort, standbyOpts); err != nil {
		t.Fatal(err)
	}
	want := "async"
	if synchronous {
		want = "sync"
	}
	storetest.WaitFor(t, 30*time.Second, "the standby to stream "+want+"hronously", func() bool {
		rows := Query(t, c.PrimaryDSN(), "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = $1", want)
		return rows[0][0] == "1"
	})
	return c
}

// StartPrimaryAlone initialises and starts the primary of StartPair, with
// synchronous_standby_names set to standbyNames, and returns it with the
// path of pg_basebackup. It stops the servers when the test ends.
func StartPrimaryAlone(t testing.TB, standbyNames string) (*Pair, string) {
	t.Helper()
	initdb, pgCtl, err := FindBinaries()
	if err != nil {
		t.Fatalf("%v\ninstall PostgreSQL's server binaries (Debian: apt-get install postgresql) "+
			"to run the failover tests", err)
	}
	// Next to the real pg_ctl (PATH may hold links to it), so that the
	// versions match.
	binDir := filepath.Dir(pgCtl)
	if real, err := filepath.EvalSymlinks(pgCtl); err == nil {
		binDir = filepath.Dir(real)
	}
	basebackup := filepath.Join(binDir, "pg_basebackup")
	if _, err := os.Stat(basebackup); err != nil {
		if basebackup, err = exec.LookPath("pg_basebackup"); err != nil {
			t.Fatalf("no pg_basebackup next to %s nor on PATH: install PostgreSQL's client binaries "+
				"(Debian: apt-get install postgresql)", pgCtl)
		}
	}
	dir, err := os.MkdirTemp("", "idempotency-pgpair-")
	if err != nil {
		t.Fatal(err)
	}
	c := &Pair{dir: dir, pgCtl: pgCtl}
	if u := ServerOwned(t, dir); u != nil {
		c.asUser = []string{"runuser", "-u", u.Username, "--"}
	}
	t.Cleanup(func() {
		_ = c.run(pgCtl, "-D", c.data("standby"), "-m", "immediate", "-w", "stop")
		_ = c.run(pgCtl, "-D", c.data("primary"), "-m", "immediate", "-w", "stop")
		if t.Failed() {
			for _, node := range []string{"primary", "standby"} {
				if out, err := os.ReadFile(c.logFile(node)); err == nil {
					if len(out) > 3000 {
						out = out[len(out)-3000:]
					}
					t.Logf("%s server log (tail):\n%s", node, out)
				}
			}
		}
		os.RemoveAll(dir)
	})
	if c.PrimaryPort, err = FreePort(); err != nil {
		t.Fatal(err)
	}
	if c.StandbyPort, err = FreePort(); err != nil {
		t.Fatal(err)
	}
	c.primaryOpts = "-c synchronous_commit=on -c synchronous_standby_names=" + standbyNames

	if err := c.run(initdb, "-D", c.data("primary"), "--username=postgres", "--auth=trust",
		"--encoding=UTF8", "--locale=C", "--no-sync"); err != nil {
		t.Fatal(err)
	}
	// fsync is off for speed: an immediate stop kills the server, not the
	// machine, so whatever a server wrote survives in the page cache.
	// The durability under test is the replication's.
	if err := c.start("primary", c.PrimaryPort, c.primaryOpts); err != nil {
		t.Fatal(err)
	}
	return c, basebackup
}

func (c *Pair) data(node string) string    { return filepath.Join(c.dir, node) }
func (c *Pair) logFile(node string) string { return filepath.Join(c.dir, node+".log") }

func (c *Pair) start(node string, port int, opts string) error {
	opts = fmt.Sprintf("-c listen_addresses=127.0.0.1 -p %d -k %s -c max_connections=200 "+
		"-c fsync=off -c full_page_writes=off %s", port, c.dir, opts)
	return c.run(c.pgCtl, "-D", c.data(node), "-l", c.logFile(node), "-o", opts, "-w", "-t", "60", "start")
}

// run runs a server binary as the server's user, in the cluster's
// directory (that user may not be allowed into the package's).
func (c *Pair) run(args ...string) error {
	args = append(slices.Clone(c.asUser), args...)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Dir = c.dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// PortDSN is the DSN of the postgres database of a test server on port.
func PortDSN(port int) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
}

// PrimaryDSN and StandbyDSN reach one server each.
func (c *Pair) PrimaryDSN() string { return PortDSN(c.PrimaryPort) }
func (c *Pair) StandbyDSN() string { return PortDSN(c.StandbyPort) }

// DSN is the connection string an application is given: both hosts, and
// only the one that accepts writes will do.
func (c *Pair) DSN() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		c.PrimaryPort, c.StandbyPort)
}

// KillPrimary stops the primary at once, as a crash would: its backends
// exit without finishing their transactions, and it does not wait for
// its standby.
func (c *Pair) KillPrimary(t testing.TB) {
	t.Helper()
	if err := c.run(c.pgCtl, "-D", c.data("primary"), "-m", "immediate", "-w", "stop"); err != nil {
		t.Fatal(err)
	}
}

// StartPrimary starts the primary again, after KillPrimary: a restart.
func (c *Pair) StartPrimary(t testing.TB) {
	t.Helper()
	if err := c.start("primary", c.PrimaryPort, c.primaryOpts); err != nil {
		t.Fatal(err)
	}
}

// Promote makes the standby the primary, and returns once it accepts
// writes.
func (c *Pair) Promote(t testing.TB) {
	t.Helper()
	if err := c.run(c.pgCtl, "-D", c.data("standby"), "-w", "-t", "30", "promote"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		conn, err := pgx.Connect(ctx, c.StandbyDSN()+"&target_session_attrs=read-write")
		if err == nil {
			conn.Close(ctx)
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("the promoted standby does not accept writes: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// lagProxy forwards connections to the primary on port, and holds what
// the primary sends for lag before passing it on. When the primary's side
// of a connection ends, what the proxy still holds is dropped, as the
// unsent WAL of a primary whose machine died is.
func lagProxy(t testing.TB, port int, lag time.Duration) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			down, err := l.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				down.Close()
				continue
			}
			go func() {
				_, _ = io.Copy(up, down)
				up.Close()
			}()
			type chunk struct {
				due  time.Time
				data []byte
			}
			chunks := make(chan chunk, 1<<16)
			gone := make(chan struct{})
			go func() {
				defer close(gone)
				for {
					b := make([]byte, 32<<10)
					n, err := up.Read(b)
					if n > 0 {
						chunks <- chunk{time.Now().Add(lag), b[:n]}
					}
					if err != nil {
						return
					}
				}
			}()
			go func() {
				defer down.Close()
				for {
					select {
					case c := <-chunks:
						select {
						case <-time.After(time.Until(c.due)):
						case <-gone:
							return
						}
						if _, err := down.Write(c.data); err != nil {
							return
						}
					case <-gone:
						return
					}
				}
			}()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

// CrashBackend kills one backend of the server at dsn with SIGKILL, as the
// OOM killer would, and returns once the server, restarted by its
// postmaster after crash recovery, accepts connections again.
func CrashBackend(t testing.TB, dsn string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	const started = "SELECT " + serverStartSQL
	var pid int
	var before time.Time
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid(), "+serverStartSQL).Scan(&pid, &before); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close(ctx)
	for {
		var after time.Time
		c, err := pgx.Connect(ctx, dsn)
		if err == nil {
			err = c.QueryRow(ctx, started).Scan(&after)
			_ = c.Close(ctx)
		}
		switch {
		case err == nil && after.After(before):
			return
		case ctx.Err() != nil:
			t.Fatalf("the server did not come back from its crash (its start %v, then %v): %v", before, after, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// serverStartSQL is when the server last started: the postmaster's start,
// or, after a crash recovery, which restarts no postmaster, the reset of
// the background writer's statistics that the recovery does.
const serverStartSQL = `GREATEST(pg_postmaster_start_time(), pg_stat_get_bgwriter_stat_reset_time())`
