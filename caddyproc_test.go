package idempotency

// Caddy as a separate process, for the tests that need what one process
// cannot give: two instances side by side (caddy.Load replaces the one
// config of a process), an instance killed with SIGKILL, and reloads
// through the admin API as an operator does them.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// caddyBinary is the Caddy of ./cmd/caddy, built once per test binary.
// IDEMPOTENCY_CADDY_RACE=1 builds it with the race detector, which the
// soak run uses: slower, but a data race in the handler then fails the run.
var caddyBinary struct {
	once sync.Once
	dir  string
	path string
	err  error
}

// buildCaddy returns the path of the built binary; the first caller pays
// for the build (a link, when the build cache is warm).
func buildCaddy(t testing.TB) string {
	t.Helper()
	b := &caddyBinary
	b.once.Do(func() {
		b.dir, b.err = os.MkdirTemp("", "idempotency-caddy-")
		if b.err != nil {
			return
		}
		b.path = filepath.Join(b.dir, "caddy")
		args := []string{"build", "-o", b.path}
		if os.Getenv("IDEMPOTENCY_CADDY_RACE") == "1" {
			args = append(args, "-race")
		}
		cmd := exec.Command("go", append(args, "./cmd/caddy")...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			b.err = fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	})
	if b.err != nil {
		t.Fatalf("building caddy: %v", b.err)
	}
	return b.path
}

// removeCaddyBinary deletes the built binary; TestMain calls it.
func removeCaddyBinary() {
	if caddyBinary.dir != "" {
		os.RemoveAll(caddyBinary.dir)
	}
}

// caddyProc is a running Caddy process with an admin endpoint, logging
// JSON to LogPath (the embedded caddyServer reads it).
type caddyProc struct {
	*caddyServer
	Name  string
	Admin string // host:port of the admin endpoint
	dir   string
	cmd   *exec.Cmd
	// exited is closed once the process has been waited for.
	exited  chan struct{}
	waitErr error
}

// startCaddyProc starts the built binary on sites (site blocks only; the
// global options are its own, globalOptionsBlock's with a grace period
// for the requests in flight), waits until its admin
// endpoint answers, and stops it when the test ends.
func startCaddyProc(t testing.TB, name, sites string) *caddyProc {
	t.Helper()
	bin := buildCaddy(t)
	dir := t.TempDir()
	p := &caddyProc{
		caddyServer: &caddyServer{LogPath: filepath.Join(dir, "caddy.log")},
		Name:        name,
		Admin:       fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t)),
		dir:         dir,
		exited:      make(chan struct{}),
	}
	cfgPath := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(cfgPath, []byte(p.caddyfile(sites)), 0o644); err != nil {
		t.Fatal(err)
	}
	stderr, err := os.Create(filepath.Join(dir, "stderr.log"))
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(bin, "run", "--config", cfgPath, "--adapter", "caddyfile")
	p.cmd.Dir = dir
	p.cmd.Stdout, p.cmd.Stderr = stderr, stderr
	// Caddy keeps state (autosave, certificates) under these; a test's
	// instance must not touch the user's.
	p.cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir)
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", name, err)
	}
	go func() {
		p.waitErr = p.cmd.Wait()
		stderr.Close()
		close(p.exited)
	}()
	t.Cleanup(func() {
		p.stop()
		if out, _ := os.ReadFile(filepath.Join(dir, "stderr.log")); strings.Contains(string(out), "DATA RACE") {
			t.Errorf("caddy %s (built with -race) reported a data race:\n%s", name, out)
		}
		if t.Failed() {
			out, _ := os.ReadFile(filepath.Join(dir, "stderr.log"))
			if len(out) > 4000 {
				out = out[len(out)-4000:]
			}
			t.Logf("caddy %s stderr (tail):\n%s", name, out)
			p.dumpModuleLog(t)
		}
	})
	if err := p.waitReady(20 * time.Second); err != nil {
		out, _ := os.ReadFile(filepath.Join(dir, "stderr.log"))
		t.Fatalf("caddy %s did not start: %v\n%s", name, err, out)
	}
	return p
}

// caddyfile is the whole Caddyfile for sites.
func (p *caddyProc) caddyfile(sites string) string {
	return globalOptionsBlock(p.LogPath, p.Admin, "5s", "INFO") + sites
}

// waitReady polls the admin endpoint until the config is loaded.
func (p *caddyProc) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		select {
		case <-p.exited:
			return fmt.Errorf("exited: %v", p.waitErr)
		default:
		}
		resp, err := http.Get("http://" + p.Admin + "/config/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("admin endpoint %s: %v", p.Admin, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Load replaces the running config with sites, as `caddy reload` does:
// POST /load with the adapted Caddyfile.
func (p *caddyProc) Load(sites string) error {
	req, err := http.NewRequest(http.MethodPost, "http://"+p.Admin+"/load", strings.NewReader(p.caddyfile(sites)))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST /load: %d %s", resp.StatusCode, body)
	}
	return nil
}

// Kill sends SIGKILL and waits for the process to be gone: no deferred
// function, no graceful shutdown, no last statement to the database.
func (p *caddyProc) Kill(t testing.TB) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		t.Fatalf("kill -9 %s: %v", p.Name, err)
	}
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s still running 10s after SIGKILL", p.Name)
	}
}

// stop asks the process to exit (SIGINT: Caddy's graceful stop), and
// kills it if it has not within a few seconds.
func (p *caddyProc) stop() {
	select {
	case <-p.exited:
		return
	default:
	}
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.exited:
	case <-time.After(8 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

// logMessages counts the module's log lines by message.
func (p *caddyProc) logMessages(t testing.TB) map[string]int {
	t.Helper()
	counts := make(map[string]int)
	for _, l := range p.moduleLogLines(t) {
		msg, _ := l["msg"].(string)
		counts[msg]++
	}
	return counts
}

// procSite is a site served by a process, with its own client.
func procSite(t testing.TB, p *caddyProc, port int) *site {
	t.Helper()
	return newSiteClient(t, p.caddyServer, port)
}

// ctxSleep sleeps for d or until ctx ends.
func ctxSleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
