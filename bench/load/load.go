// Package load is the closed-loop load generator that the benchmark's rows
// share: a fixed number of workers, each issuing one operation after the
// other for a fixed duration, with the latency of every operation kept.
//
// Every row of the benchmark (HTTP through Caddy, or SQL straight through
// pgx) runs through Run, so that throughput and latency are measured the
// same way everywhere.
package load

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Config says how hard and how long to load.
type Config struct {
	// Concurrency is the number of workers, each with one operation in
	// flight at a time.
	Concurrency int
	// Warmup is run first and not measured: connections are opened,
	// statements prepared, caches warmed.
	Warmup time.Duration
	// Duration is the measured window.
	Duration time.Duration
	// Count, when > 0, stops after this many operations in all instead
	// of after Duration (used to preload keys). Warmup is then ignored.
	Count int64
}

// Op performs one operation. It returns an error when the operation
// failed or its answer was not the expected one.
type Op func(ctx context.Context, seq int64) error

// Result is what Run measured.
type Result struct {
	Requests   int64         `json:"requests"`
	Errors     int64         `json:"errors"`
	FirstError string        `json:"first_error,omitempty"`
	Seconds    float64       `json:"seconds"`
	RPS        float64       `json:"rps"`
	P50        time.Duration `json:"p50_ns"`
	P90        time.Duration `json:"p90_ns"`
	P99        time.Duration `json:"p99_ns"`
	Max        time.Duration `json:"max_ns"`
}

func (r Result) String() string {
	return fmt.Sprintf("%.0f req/s, p50 %s, p99 %s, %d requests, %d errors",
		r.RPS, r.P50.Round(time.Microsecond), r.P99.Round(time.Microsecond), r.Requests, r.Errors)
}

// Run runs newOp's operations from cfg.Concurrency workers. newOp is
// called once per worker, before the clock starts, so that a worker can
// hold its own connection. seq is a sequence number unique across all
// workers of the run, starting at 0 (operations of the warmup included),
// from which an operation can derive a unique key.
func Run(ctx context.Context, cfg Config, newOp func(worker int) (Op, error)) (Result, error) {
	if cfg.Concurrency <= 0 {
		return Result{}, fmt.Errorf("load: concurrency must be positive")
	}
	ops := make([]Op, cfg.Concurrency)
	for i := range ops {
		op, err := newOp(i)
		if err != nil {
			return Result{}, err
		}
		ops[i] = op
	}

	var (
		seq      atomic.Int64
		measure  atomic.Bool
		errs     atomic.Int64
		firstErr atomic.Value
		wg       sync.WaitGroup
		lats     = make([][]time.Duration, cfg.Concurrency)
	)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	if cfg.Count > 0 {
		measure.Store(true)
	}
	for i, op := range ops {
		wg.Add(1)
		go func() {
			defer wg.Done()
			own := make([]time.Duration, 0, 1<<14)
			for runCtx.Err() == nil {
				n := seq.Add(1) - 1
				if cfg.Count > 0 && n >= cfg.Count {
					break
				}
				start := time.Now()
				err := op(runCtx, n)
				lat := time.Since(start)
				if !measure.Load() || runCtx.Err() != nil {
					continue
				}
				if err != nil {
					if errs.Add(1) == 1 {
						firstErr.Store(err.Error())
					}
					continue
				}
				own = append(own, lat)
			}
			lats[i] = own
		}()
	}

	var elapsed time.Duration
	if cfg.Count > 0 {
		start := time.Now()
		wg.Wait()
		elapsed = time.Since(start)
	} else {
		select {
		case <-time.After(cfg.Warmup):
		case <-ctx.Done():
		}
		if err := ctx.Err(); err != nil {
			cancel()
			wg.Wait()
			return Result{}, err
		}
		measure.Store(true)
		start := time.Now()
		// The window ends after Duration or, earlier, when ctx is done
		// (the scale benchmark stops a run when pruning ends).
		select {
		case <-time.After(cfg.Duration):
		case <-ctx.Done():
		}
		// Operations still in flight when the window closes are not
		// counted: they see runCtx cancelled when they return.
		measure.Store(false)
		elapsed = time.Since(start)
		cancel()
		wg.Wait()
	}
	if err := ctx.Err(); err != nil && cfg.Count > 0 {
		return Result{}, err
	}

	var all []time.Duration
	for _, l := range lats {
		all = append(all, l...)
	}
	slices.Sort(all)
	r := Result{
		Requests: int64(len(all)),
		Errors:   errs.Load(),
		Seconds:  elapsed.Seconds(),
	}
	if s, ok := firstErr.Load().(string); ok {
		r.FirstError = s
	}
	r.RPS = float64(r.Requests) / r.Seconds
	if len(all) > 0 {
		r.P50 = percentile(all, 0.50)
		r.P90 = percentile(all, 0.90)
		r.P99 = percentile(all, 0.99)
		r.Max = all[len(all)-1]
	}
	return r, nil
}

// percentile returns the q-quantile of sorted (nearest rank).
func percentile(sorted []time.Duration, q float64) time.Duration {
	i := int(q*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
