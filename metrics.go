package idempotency

import (
	"context"
	"errors"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// The collectors are created once per process and registered in the
// metrics registry of every config that uses the handler: Caddy gives
// each config a registry of its own, and counters that survive a reload
// are what Prometheus expects. No label carries a key or a credential:
// they are unbounded, and a credential's hash is not for a dashboard.
const (
	metricsNamespace = "caddy"
	metricsSubsystem = "idempotency"
)

var (
	requestsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "requests_total",
		Help:      "Protected requests, by result ({http.idempotency.result}).",
	}, []string{"result"})

	storeDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "store_duration_seconds",
		Help:      "Duration of store round trips, by operation.",
		// From a sub-millisecond memory store to the 5s store timeout.
		Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
	}, []string{"operation"})

	storeErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "store_errors_total",
		Help:      "Failed store operations, by operation (a lost lock is not a failure).",
	}, []string{"operation"})

	lockTakeovers = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "lock_takeovers_total",
		Help:      "In-progress records whose stale lock a retry took over (their owner presumably died).",
	})

	prunedRecords = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "pruned_records_total",
		Help:      "Expired records deleted by this instance's pruning.",
	})

	replayAge = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "replay_age_seconds",
		Help:      "Age of the record at each replay: how long after the first request its retries come.",
		Buckets:   []float64{.1, .5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600},
	})
)

// The store operations, as the operation label names them. Their
// observers are looked up once: the request path should not hash label
// values.
const (
	opAcquire  = "acquire"
	opComplete = "complete"
	opRelease  = "release"
	opRenew    = "renew"
	opPrune    = "prune"
)

type opMetrics struct {
	duration prometheus.Observer
	errors   prometheus.Counter
}

var storeOps = func() map[string]opMetrics {
	m := make(map[string]opMetrics)
	for _, op := range []string{opAcquire, opComplete, opRelease, opRenew, opPrune} {
		m[op] = opMetrics{storeDuration.WithLabelValues(op), storeErrors.WithLabelValues(op)}
	}
	return m
}()

// resultCounters holds the counter of every result that enforcing mode
// gives: each is a series from the start, at 0, so that rate() and
// alerts work before the first occurrence, and counting one is a map
// lookup.
var resultCounters = func() map[string]prometheus.Counter {
	m := make(map[string]prometheus.Counter)
	for _, r := range []string{resultExecuted, resultReplayed, resultMismatch, resultInProgress,
		resultRejected, resultReleased, resultStoreError, resultNoKey, resultFailOpen} {
		m[r] = requestsTotal.WithLabelValues(r)
	}
	return m
}()

// provisionMetrics registers the collectors in the config's registry,
// which the admin endpoint's /metrics and the metrics handler serve, and
// instruments the store.
func (h *Handler) provisionMetrics(ctx caddy.Context) error {
	reg := ctx.GetMetricsRegistry()
	for _, c := range []prometheus.Collector{requestsTotal, storeDuration, storeErrors, lockTakeovers, prunedRecords, replayAge} {
		// Several handlers in one config register the same collectors.
		if err := reg.Register(c); err != nil && !errors.As(err, new(prometheus.AlreadyRegisteredError)) {
			return err
		}
	}
	h.store = instrumentedStore{h.store}
	return nil
}

// countResult counts a protected request once it is done, by its final
// result: an execution can still turn into a release.
func countResult(repl *caddy.Replacer) {
	result, ok := repl.GetString("http.idempotency.result")
	if !ok || result == "" {
		return
	}
	if c, ok := resultCounters[result]; ok {
		c.Inc()
		return
	}
	// Shadow mode's results, a bounded set too.
	requestsTotal.WithLabelValues(result).Inc()
}

// instrumentedStore times each round trip of the store it wraps and
// counts what the handler does not see: takeovers and pruned records. It
// adds no round trip.
type instrumentedStore struct{ Store }

// observe records one round trip. An error is a store failure unless
// the caller gave up (a client that left, a config that unloaded) or
// lost its lock; a store that timed out has failed.
func observe(ctx context.Context, op string, start time.Time, err error) {
	m := storeOps[op]
	m.duration.Observe(time.Since(start).Seconds())
	if err != nil && !errors.Is(err, ErrLockLost) && !errors.Is(ctx.Err(), context.Canceled) {
		m.errors.Inc()
	}
}

func (s instrumentedStore) Acquire(ctx context.Context, req AcquireRequest) (AcquireResult, error) {
	start := time.Now()
	res, err := s.Store.Acquire(ctx, req)
	observe(ctx, opAcquire, start, err)
	if err == nil && res.Outcome == OutcomeTakenOver {
		lockTakeovers.Inc()
	}
	return res, err
}

func (s instrumentedStore) Complete(ctx context.Context, key RecordKey, token LockToken, resp *Response, retention time.Duration) error {
	start := time.Now()
	err := s.Store.Complete(ctx, key, token, resp, retention)
	observe(ctx, opComplete, start, err)
	return err
}

func (s instrumentedStore) Release(ctx context.Context, key RecordKey, token LockToken) error {
	start := time.Now()
	err := s.Store.Release(ctx, key, token)
	observe(ctx, opRelease, start, err)
	return err
}

func (s instrumentedStore) Renew(ctx context.Context, key RecordKey, token LockToken) error {
	start := time.Now()
	err := s.Store.Renew(ctx, key, token)
	observe(ctx, opRenew, start, err)
	return err
}

func (s instrumentedStore) Prune(ctx context.Context, batchSize int) (int64, error) {
	start := time.Now()
	n, err := s.Store.Prune(ctx, batchSize)
	observe(ctx, opPrune, start, err)
	prunedRecords.Add(float64(n))
	return n, err
}

// Interface guards
var _ Store = instrumentedStore{}
