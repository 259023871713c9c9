package idempotency

import (
	"context"
	"errors"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// The collectors are created once per process and registered in the
// metrics registry of every config that uses the handler: Caddy gives
// each config a registry of its own, and counters that survive a reload
// are what Prometheus expects. No label carries a key or a credential:
// they are unbounded, and a credential's hash is not for a dashboard.
// Nor the Host header, which the client chooses: the server label is the
// name of the config's HTTP server, as Caddy's own caddy_http_* metrics
// label it, so the two join. Every series but the process's body budget
// carries it, so that a dashboard shows one server's traffic alone.
const (
	metricsNamespace = "caddy"
	metricsSubsystem = "idempotency"
)

var (
	requestsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "requests_total",
		Help:      "Protected requests, by HTTP server and result ({http.idempotency.result}).",
	}, []string{"server", "result"})

	storeDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "store_duration_seconds",
		Help:      "Duration of store round trips, by HTTP server and operation.",
		// From a sub-millisecond memory store to the 5s store timeout.
		Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
	}, []string{"server", "operation"})

	storeErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "store_errors_total",
		Help:      "Failed store operations, by HTTP server and operation (a lost lock is not a failure; startup: an attempt to migrate a store or read its secret, retried).",
	}, []string{"server", "operation"})

	lockTakeovers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "lock_takeovers_total",
		Help:      "In-progress records whose stale lock a retry took over (their owner presumably died), by HTTP server.",
	}, []string{"server"})

	lockLost = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "lock_lost_total",
		Help:      "Renewals, completions and releases that found their lock taken over (idempotency.lock_lost), by HTTP server and operation.",
	}, []string{"server", "operation"})

	notReplayable = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "not_replayable_total",
		Help:      "Retries answered 409 because the first response was not stored for replay (their result is rejected), by HTTP server.",
	}, []string{"server"})

	prunedRecords = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "pruned_records_total",
		Help:      "Expired records deleted by this instance's pruning, by the HTTP server of the handler that pruned.",
	}, []string{"server"})

	bodyBudgetRefusals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "request_body_budget_refusals_total",
		Help:      "Requests answered 503 because buffering their bodies would exceed request_body_budget (their result is rejected), by HTTP server.",
	}, []string{"server"})

	bufferedBodies = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "request_body_buffered_bytes",
		Help:      "Bytes of request bodies buffered now, as reserved from request_body_budget.",
	}, bufferedBodyBytes)

	replayAge = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: metricsNamespace,
		Subsystem: metricsSubsystem,
		Name:      "replay_age_seconds",
		Help:      "Age of the record at each replay: how long after the first request its retries come, by HTTP server.",
		Buckets:   []float64{.1, .5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600},
	}, []string{"server"})
)

type opMetrics struct {
	duration prometheus.Observer
	errors   prometheus.Counter
}

// storeMetrics are the series a handler's store operations count in, on
// its HTTP server. They are looked up once: the request path should not
// hash label values.
type storeMetrics struct {
	ops       map[string]opMetrics
	takeovers prometheus.Counter
	pruned    prometheus.Counter
	// log is told each call's outcome, which begins or ends an outage
	// (storelog.go); nil for a store that no handler logs for.
	log *storeLog
}

func newStoreMetrics(server string) *storeMetrics {
	m := &storeMetrics{
		ops:       make(map[string]opMetrics),
		takeovers: lockTakeovers.WithLabelValues(server),
		pruned:    prunedRecords.WithLabelValues(server),
	}
	for _, op := range []string{store.OpAcquire, store.OpComplete, store.OpRelease, store.OpRenew, store.OpPrune} {
		m.ops[op] = opMetrics{duration: storeDuration.WithLabelValues(server, op), errors: storeErrors.WithLabelValues(server, op)}
	}
	return m
}

// startupErrors is the counter of the failed attempts of the stores of
// server's handlers to start (store.StartCounter), created at 0 so that
// an alert works before the first one.
func startupErrors(server string) prometheus.Counter {
	return storeErrors.WithLabelValues(server, "startup")
}

// handlerMetrics is what a handler counts its requests with: the name of
// its HTTP server, and that server's counters by result.
type handlerMetrics struct {
	server             string
	results            map[string]prometheus.Counter
	notReplayable      prometheus.Counter
	bodyBudgetRefusals prometheus.Counter
	replayAge          prometheus.Observer
	// lockLost counts the handler's idempotency.lock_lost lines, where
	// they are logged: not every ErrLockLost a store returns is one (a
	// renewal that reaches the store after its own completion finds the
	// lock gone, and nothing was lost).
	lockLost lockLostCounters
}

type lockLostCounters struct{ complete, release, renew prometheus.Counter }

func newHandlerMetrics(server string) handlerMetrics {
	return handlerMetrics{
		server:             server,
		results:            resultCounters(server),
		notReplayable:      notReplayable.WithLabelValues(server),
		bodyBudgetRefusals: bodyBudgetRefusals.WithLabelValues(server),
		replayAge:          replayAge.WithLabelValues(server),
		lockLost: lockLostCounters{
			lockLost.WithLabelValues(server, store.OpComplete),
			lockLost.WithLabelValues(server, store.OpRelease),
			lockLost.WithLabelValues(server, store.OpRenew),
		},
	}
}

// resultCounters returns the counter of every result that enforcing mode
// gives on the named server: each is a series from the start, at 0, so
// that rate() and alerts work before the first occurrence, and counting
// one is a map lookup.
func resultCounters(server string) map[string]prometheus.Counter {
	m := make(map[string]prometheus.Counter)
	for _, r := range []string{resultExecuted, resultReplayed, resultMismatch, resultInProgress,
		resultRejected, resultReleased, resultStoreError, resultUnreadable, resultUnverified, resultNoKey, resultFailOpen} {
		m[r] = requestsTotal.WithLabelValues(server, r)
	}
	return m
}

// provisionMetrics registers the collectors in the config's registry,
// which the admin endpoint's /metrics and the metrics handler serve
// (wrapStore instruments the store).
func (h *Handler) provisionMetrics(ctx caddy.Context) error {
	reg := ctx.GetMetricsRegistry()
	for _, c := range []prometheus.Collector{requestsTotal, storeDuration, storeErrors, lockTakeovers, lockLost, notReplayable, prunedRecords, bodyBudgetRefusals, bufferedBodies, replayAge, buildInfo} {
		// Several handlers in one config register the same collectors.
		if err := reg.Register(c); err != nil && !errors.As(err, new(prometheus.AlreadyRegisteredError)) {
			return err
		}
	}
	h.metrics = newHandlerMetrics(store.ServerName(ctx))
	return nil
}

// countResult counts a protected request once it is done, by its final
// result: an execution can still turn into a release.
func (h *Handler) countResult(repl *caddy.Replacer) {
	result, ok := repl.GetString(resultPlaceholder)
	if !ok || result == "" {
		return
	}
	if c, ok := h.metrics.results[result]; ok {
		c.Inc()
		return
	}
	// Shadow mode's results, a bounded set too.
	requestsTotal.WithLabelValues(h.metrics.server, result).Inc()
}

// instrumentedStore times each round trip of the store it wraps and
// counts takeovers and pruned records. It adds no round trip.
type instrumentedStore struct {
	store.Store
	m *storeMetrics
}

// observe records one round trip. An error is a store failure unless
// the caller gave up (a client that left, a config that unloaded) or
// lost its lock (handlerMetrics.lockLost); a store that timed out has
// failed.
func (s instrumentedStore) observe(ctx context.Context, op string, start time.Time, epoch int64, err error) {
	if errors.Is(err, store.ErrRecordUnreadable) {
		// The store answered, with a record that cannot be read: no
		// failure of the store's.
		err = nil
	}
	m := s.m.ops[op]
	m.duration.Observe(time.Since(start).Seconds())
	m.count(ctx, err)
	s.m.log.observed(ctx, op, epoch, err)
}

// count counts err, the outcome of one lock's operation, if it is an
// error.
func (m opMetrics) count(ctx context.Context, err error) {
	if err != nil && !errors.Is(err, store.ErrLockLost) && !errors.Is(ctx.Err(), context.Canceled) {
		m.errors.Inc()
	}
}

func (s instrumentedStore) Acquire(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	start, epoch := time.Now(), s.m.log.begin()
	res, err := s.Store.Acquire(ctx, req)
	s.observe(ctx, store.OpAcquire, start, epoch, err)
	if err == nil && res.Outcome == store.OutcomeTakenOver {
		s.m.takeovers.Inc()
	}
	return res, err
}

func (s instrumentedStore) Complete(ctx context.Context, key store.RecordKey, token store.LockToken, resp *store.Response, retention time.Duration) error {
	start, epoch := time.Now(), s.m.log.begin()
	err := s.Store.Complete(ctx, key, token, resp, retention)
	s.observe(ctx, store.OpComplete, start, epoch, err)
	return err
}

func (s instrumentedStore) Release(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	start, epoch := time.Now(), s.m.log.begin()
	err := s.Store.Release(ctx, key, token)
	s.observe(ctx, store.OpRelease, start, epoch, err)
	return err
}

func (s instrumentedStore) Renew(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	start, epoch := time.Now(), s.m.log.begin()
	err := s.Store.Renew(ctx, key, token)
	s.observe(ctx, store.OpRenew, start, epoch, err)
	return err
}

func (s instrumentedStore) Prune(ctx context.Context, batchSize int) (int64, error) {
	start, epoch := time.Now(), s.m.log.begin()
	n, err := s.Store.Prune(ctx, batchSize)
	s.observe(ctx, store.OpPrune, start, epoch, err)
	s.m.pruned.Add(float64(n))
	return n, err
}

// Unwrap returns the store that s measures (store.As).
func (s instrumentedStore) Unwrap() store.Store { return s.Store }

// Interface guards
var (
	_ store.Store       = instrumentedStore{}
	_ store.LockRenewer = instrumentedStore{}
	_ store.Wrapper     = instrumentedStore{}
)

// RenewLocks implements LockRenewer: one round trip, so one duration;
// lost locks and errors are counted per lock, as single renewals count
// them.
func (s instrumentedStore) RenewLocks(ctx context.Context, locks []store.HeldLock) []error {
	start, epoch := time.Now(), s.m.log.begin()
	errs := renewLocks(ctx, s.Store, locks)
	m := s.m.ops[store.OpRenew]
	m.duration.Observe(time.Since(start).Seconds())
	var failed error
	for _, err := range errs {
		m.count(ctx, err)
		if err != nil && failed == nil && s.m.log.noAnswer(err) {
			failed = err
		}
	}
	// One round trip: the store answered it, or did not.
	s.m.log.observed(ctx, store.OpRenew, epoch, failed)
	return errs
}
