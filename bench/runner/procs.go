package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/caddy-idempotency/idempotency/bench/load"
)

// bench holds what every row shares: the built binaries, the upstream,
// the CPU sampler and where logs go.
type bench struct {
	cfg      config
	bin      string // directory of the built binaries
	logs     string // directory of the logs and results
	upstream string // host:port
	sampler  *cpuSampler
	upProc   *exec.Cmd
	// pooler is rows 2b and 3b's PgBouncer, once started, or
	// poolerMissing why there is none.
	pooler        *pooler
	poolerMissing string
}

// freePort returns a port on 127.0.0.1 that nothing listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func waitListening(addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nothing listens on %s after %s", addr, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// build compiles Caddy (with the module), the load generator, the
// upstream and the ceiling test binary, once per run.
func (b *bench) build(root string) error {
	steps := [][]string{
		{"go", "build", "-o", filepath.Join(b.bin, "caddy"), "./cmd/caddy"},
		{"go", "build", "-o", filepath.Join(b.bin, "loadgen"), "./bench/loadgen"},
		{"go", "build", "-o", filepath.Join(b.bin, "upstream"), "./bench/upstream"},
		{"go", "test", "-c", "-o", filepath.Join(b.bin, "ceiling.test"), "./stores/postgres"},
	}
	for _, s := range steps {
		cmd := exec.Command(s[0], s[1:]...)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v\n%s", strings.Join(s, " "), err, out)
		}
	}
	return nil
}

func (b *bench) startUpstream() error {
	port, err := freePort()
	if err != nil {
		return err
	}
	b.upstream = fmt.Sprintf("127.0.0.1:%d", port)
	log, err := os.Create(filepath.Join(b.logs, "upstream.log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(b.bin, "upstream"), "-listen", b.upstream)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return err
	}
	b.upProc = cmd
	b.sampler.track(cmd.Process.Pid, "upstream")
	return waitListening(b.upstream, 10*time.Second)
}

func (b *bench) stopUpstream() {
	if b.upProc != nil {
		_ = b.upProc.Process.Kill()
		_ = b.upProc.Wait()
	}
}

// caddyProc is Caddy running one row's Caddyfile.
type caddyProc struct {
	cmd  *exec.Cmd
	addr string
	// admin is Caddy's admin address, "off" unless -profile is given.
	admin string
	log   *os.File
}

// profile writes a CPU profile of Caddy, taken for d, to path.
func (c *caddyProc) profile(ctx context.Context, d time.Duration, path string) error {
	return c.pprof(ctx, fmt.Sprintf("profile?seconds=%d", max(1, int(d.Seconds()))), path)
}

// pprof writes Caddy's pprof profile of query (under /debug/pprof/) to
// path.
func (c *caddyProc) pprof(ctx context.Context, query, path string) error {
	url := fmt.Sprintf("http://%s/debug/pprof/%s", c.admin, query)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// startCaddy runs Caddy with the site block body on a free port.
func (b *bench) startCaddy(name, site string) (*caddyProc, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	admin := "off"
	if b.cfg.profile != "" {
		// The profile is read from Caddy's admin endpoint, which is
		// otherwise off: it costs nothing while it is not asked.
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		admin = fmt.Sprintf("127.0.0.1:%d", port)
	}
	caddyfile := fmt.Sprintf(`{
	admin %s
	auto_https off
	persist_config off
	grace_period 1s
}

http://%s {
%s
}
`, admin, addr, site)
	path := filepath.Join(b.logs, name+".Caddyfile")
	if err := os.WriteFile(path, []byte(caddyfile), 0o644); err != nil {
		return nil, err
	}
	log, err := os.Create(filepath.Join(b.logs, name+".caddy.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(b.bin, "caddy"), "run", "--config", path, "--adapter", "caddyfile")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, err
	}
	b.sampler.track(cmd.Process.Pid, "caddy")
	c := &caddyProc{cmd: cmd, addr: addr, admin: admin, log: log}
	if err := waitListening(addr, 30*time.Second); err != nil {
		c.stop()
		return nil, fmt.Errorf("%s: caddy did not start (see %s): %v", name, log.Name(), err)
	}
	return c, nil
}

// peakRSS returns Caddy's peak resident set size, in bytes.
func (c *caddyProc) peakRSS() int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", c.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var kb int64
			fmt.Sscanf(strings.TrimSpace(v), "%d", &kb)
			return kb << 10
		}
	}
	return 0
}

func (c *caddyProc) stop() {
	_ = c.cmd.Process.Signal(syscall.SIGINT)
	done := make(chan struct{})
	go func() { _ = c.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		_ = c.cmd.Process.Kill()
		<-done
	}
	c.log.Close()
}

// measurement is one row's figures.
type measurement struct {
	load.Result
	// CPU is the share of a core each category used during the row.
	CPU map[string]float64 `json:"cpu"`
}

// runLoad runs the load generator against addr with args, and measures
// where the CPU went meanwhile. stop, if not nil, ends the measured
// window early when it is closed.
func (b *bench) runLoad(ctx context.Context, name, addr string, warmup time.Duration, stop <-chan struct{}, args ...string) (measurement, error) {
	args = append([]string{"-addr", addr, "-c", fmt.Sprint(b.cfg.concurrency)}, args...)
	return b.measure(ctx, name, "loadgen", exec.Command(filepath.Join(b.bin, "loadgen"), args...), warmup, stop, func(out, _ []byte) (load.Result, error) {
		var r load.Result
		err := json.Unmarshal(bytes.TrimSpace(out), &r)
		return r, err
	})
}

// runCeiling runs TestBenchCeiling in mode with env.
func (b *bench) runCeiling(ctx context.Context, name, mode string, env map[string]string) (measurement, map[string]any, error) {
	outPath := filepath.Join(b.logs, name+".json")
	cmd := exec.Command(filepath.Join(b.bin, "ceiling.test"), "-test.run", "^TestBenchCeiling$", "-test.count", "1", "-test.v")
	cmd.Env = append(os.Environ(),
		"IDEMPOTENCY_BENCH_CEILING="+mode,
		"IDEMPOTENCY_BENCH_OUT="+outPath,
		"IDEMPOTENCY_BENCH_CONCURRENCY="+fmt.Sprint(b.cfg.concurrency),
		"IDEMPOTENCY_BENCH_DURATION="+b.cfg.duration.String(),
		"IDEMPOTENCY_BENCH_WARMUP="+b.cfg.warmup.String(),
		"IDEMPOTENCY_BENCH_DSN="+b.cfg.appDSN(),
	)
	for k, v := range env {
		cmd.Env = append(cmd.Env, "IDEMPOTENCY_BENCH_"+k+"="+v)
	}
	var extra map[string]any
	warmup := b.cfg.warmup
	if mode == "preload" || mode == "prune" {
		warmup = 0
	}
	m, err := b.measure(ctx, name, "pgx client", cmd, warmup, nil, func([]byte, []byte) (load.Result, error) {
		data, err := os.ReadFile(outPath)
		if err != nil {
			return load.Result{}, err
		}
		var out struct {
			Result load.Result `json:"result"`
		}
		if err := json.Unmarshal(data, &out); err != nil {
			return load.Result{}, err
		}
		err = json.Unmarshal(data, &extra)
		return out.Result, err
	})
	return m, extra, err
}

// measure runs cmd, snapshots the CPU after warmup and at the end, and
// parses its result from its output (stdout, stderr).
func (b *bench) measure(ctx context.Context, name, category string, cmd *exec.Cmd, warmup time.Duration, stop <-chan struct{}, parse func(stdout, stderr []byte) (load.Result, error)) (measurement, error) {
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		return measurement{}, err
	}
	b.sampler.track(cmd.Process.Pid, category)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()

	var err error
	select {
	case <-time.After(warmup):
	case err = <-done:
		done <- err
	}
	b.sampler.sample()
	before, procsBefore := b.sampler.snapshot()
	start := time.Now()
	select {
	case err = <-done:
	case <-stop:
		_ = cmd.Process.Signal(os.Interrupt)
		err = <-done
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		<-done
		return measurement{}, ctx.Err()
	}
	b.sampler.sample()
	after, procsAfter := b.sampler.snapshot()
	seconds := time.Since(start).Seconds()

	_ = os.WriteFile(filepath.Join(b.logs, name+".out"), append(stdout.Bytes(), stderr.Bytes()...), 0o644)
	if err != nil {
		return measurement{}, fmt.Errorf("%s: %v\n%s%s", name, err, lastLines(stdout.String(), 20), lastLines(stderr.String(), 20))
	}
	res, err := parse(stdout.Bytes(), stderr.Bytes())
	if err != nil {
		return measurement{}, fmt.Errorf("%s: reading the result: %v\n%s", name, err, lastLines(stdout.String()+stderr.String(), 20))
	}
	return measurement{Result: res, CPU: cpuWindow(before, after, procsBefore, procsAfter, seconds)}, nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n") + "\n"
}

// runPgbench runs pgbench -M prepared on script (in dir, with the
// constant variables of its vars.txt; see writePgbenchScripts in
// stores/postgres/ceiling_test.go) at the benchmark's concurrency, for the warmup and the
// row's duration, and measures the seconds after the warmup from
// pgbench's per-second progress reports.
func (b *bench) runPgbench(ctx context.Context, name, dir, script string) (measurement, error) {
	vars, err := os.ReadFile(filepath.Join(dir, "vars.txt"))
	if err != nil {
		return measurement{}, err
	}
	total := b.cfg.warmup + b.cfg.duration
	args := []string{"-n", "-M", "prepared", "-c", fmt.Sprint(b.cfg.concurrency), "-j", fmt.Sprint(runtime.NumCPU()),
		"-T", fmt.Sprint(int(total.Round(time.Second).Seconds())), "-P", "1", "-f", filepath.Join(dir, script)}
	for _, v := range strings.Fields(string(vars)) {
		args = append(args, "-D", v)
	}
	cmd := exec.Command("pgbench", append(args, b.cfg.dsn)...)
	// The CPU sampler tells the benchmark's Postgres backends by their
	// application_name, as the DSN of the pgx rows sets it.
	cmd.Env = append(os.Environ(), "PGAPPNAME=idempotency-bench")
	warmup := b.cfg.warmup.Round(time.Second)
	return b.measure(ctx, name, "pgx client", cmd, warmup, nil, func(_, stderr []byte) (load.Result, error) {
		return pgbenchProgress(stderr, warmup)
	})
}

// pgbenchProgress reads pgbench's "progress: 3.0 s, 1480.1 tps, ..."
// lines and sums the transactions of the seconds after warmup.
func pgbenchProgress(out []byte, warmup time.Duration) (load.Result, error) {
	var res load.Result
	for _, line := range strings.Split(string(out), "\n") {
		var at, tps float64
		if _, err := fmt.Sscanf(line, "progress: %f s, %f tps", &at, &tps); err != nil {
			continue
		}
		if at <= warmup.Seconds() {
			continue
		}
		res.Requests += int64(tps + 0.5)
		res.Seconds++
		if strings.Contains(line, "failed") && !strings.Contains(line, " 0 failed") {
			res.Errors++
		}
	}
	if res.Seconds == 0 {
		return res, fmt.Errorf("no progress report after the %s warmup", warmup)
	}
	res.RPS = float64(res.Requests) / res.Seconds
	return res, nil
}
