package main

// Where the CPU went during a row: the machine has two cores, shared by
// the load generator, Caddy, the upstream and Postgres, and by anything
// else running on it. A sampler reads /proc a few times a second and
// attributes every process's CPU time to the benchmark's processes or to
// "other": a row measured while something else was busy says so.

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// cpuSample is cumulative CPU time, in clock ticks, per category.
type cpuSample map[string]float64

// cpuSampler keeps the last CPU time seen of every process, so that
// processes that exit during a row (the load generator, a compiler run by
// someone else) are counted up to their last sample.
type cpuSampler struct {
	mu      sync.Mutex
	ours    map[int]string // pid → category, for the benchmark's processes
	pgOurs  map[int]bool   // Postgres backends serving the benchmark
	last    map[int]procCPU
	busy    float64 // machine-wide busy ticks (/proc/stat)
	dsn     string
	stopped chan struct{}
	cancel  context.CancelFunc
}

type procCPU struct {
	ticks    float64
	category string
}

func newCPUSampler(dsn string) *cpuSampler {
	ctx, cancel := context.WithCancel(context.Background())
	s := &cpuSampler{
		ours:    make(map[int]string),
		pgOurs:  make(map[int]bool),
		last:    make(map[int]procCPU),
		dsn:     dsn,
		stopped: make(chan struct{}),
		cancel:  cancel,
	}
	go s.loop(ctx)
	return s
}

func (s *cpuSampler) stop() {
	s.cancel()
	<-s.stopped
}

// track attributes pid (and its threads) to category.
func (s *cpuSampler) track(pid int, category string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ours[pid] = category
}

func (s *cpuSampler) loop(ctx context.Context) {
	defer close(s.stopped)
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		// Which Postgres backends serve the benchmark: those whose
		// application_name says so.
		if conn == nil {
			c, err := pgx.Connect(ctx, s.dsn)
			if err == nil {
				conn = c
			}
		}
		if conn != nil {
			rows, err := conn.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'idempotency-bench%'`)
			if err == nil {
				pids, _ := pgx.CollectRows(rows, pgx.RowTo[int32])
				s.mu.Lock()
				for _, pid := range pids {
					s.pgOurs[int(pid)] = true
				}
				s.mu.Unlock()
			} else {
				conn.Close(context.Background())
				conn = nil
			}
		}
		s.sample()
		select {
		case <-ctx.Done():
			s.sample()
			return
		case <-t.C:
		}
	}
}

// sample reads every process's CPU time.
func (s *cpuSampler) sample() {
	busy := readBusyTicks()
	entries, _ := os.ReadDir("/proc")
	seen := make(map[int]procCPU, len(entries))
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, ticks, ok := readProcStat(pid)
		if !ok {
			continue
		}
		seen[pid] = procCPU{ticks: ticks, category: comm}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.busy = busy
	for pid, p := range seen {
		switch cat, ok := s.ours[pid]; {
		case ok:
			p.category = cat
		case p.category == "postgres" && (s.pgOurs[pid] || !isBackend(pid)):
			// Our backends, and the server's own processes (WAL
			// writer, checkpointer), which work for whoever writes.
			p.category = "postgres"
		default:
			p.category = "other"
		}
		s.last[pid] = p
	}
}

// snapshot returns the cumulative ticks per category, and machine-wide.
func (s *cpuSampler) snapshot() (cpuSample, map[int]procCPU) {
	s.mu.Lock()
	defer s.mu.Unlock()
	procs := make(map[int]procCPU, len(s.last))
	for pid, p := range s.last {
		procs[pid] = p
	}
	return cpuSample{"busy": s.busy}, procs
}

// cpuWindow is the CPU used per category between two snapshots, as a
// share of the machine (1.0 = one core).
func cpuWindow(before, after cpuSample, procsBefore, procsAfter map[int]procCPU, seconds float64) map[string]float64 {
	out := map[string]float64{}
	hz := 100.0 // USER_HZ
	for pid, a := range procsAfter {
		// A process born during the window counts from zero.
		if d := a.ticks - procsBefore[pid].ticks; d > 0 {
			out[a.category] += d / hz / seconds
		}
	}
	out["busy"] = (after["busy"] - before["busy"]) / hz / seconds
	return out
}

// readBusyTicks returns the machine's busy time: all but idle and iowait.
func readBusyTicks() float64 {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	f := strings.Fields(line)
	var total, idle float64
	for i, v := range f[1:] {
		n, _ := strconv.ParseFloat(v, 64)
		if i >= 8 { // guest time is already in user
			break
		}
		total += n
		if i == 3 || i == 4 {
			idle += n
		}
	}
	return total - idle
}

// readProcStat returns a process's command name and its CPU time
// (utime + stime, in ticks).
func readProcStat(pid int) (string, float64, bool) {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return "", 0, false
	}
	s := string(data)
	open, close := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || close < open {
		return "", 0, false
	}
	comm := s[open+1 : close]
	f := strings.Fields(s[close+1:])
	// After the command: state is field 3 of stat, utime 14 and stime 15.
	if len(f) < 13 {
		return "", 0, false
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return comm, ut + st, true
}

// isBackend reports whether a postgres process serves a client
// connection (its title names the client's address).
func isBackend(pid int) bool {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
	if err != nil {
		return false
	}
	title := string(data)
	return strings.Contains(title, "(") && strings.Contains(title, ")")
}
