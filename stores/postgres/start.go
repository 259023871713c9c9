package postgres

// A Postgres store's start: its migrations and the first read of its
// table's credential secret. They wait until Caddy runs the config, and
// then happen in the background, retried until the database answers, so
// that a database that is down neither keeps Caddy from starting (and
// serving its other sites) nor is written to by `caddy validate`. Until
// the store is ready, its requests answer 503: nothing executes
// unprotected.

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/startup"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// The delays between a store's attempts to start: doubling from the
// first to the last, which they then keep until the database answers.
const (
	startupBackoff    = 100 * time.Millisecond
	startupMaxBackoff = 5 * time.Second
	// startupReminder is how often a store that still cannot start says
	// so again, between its first failure and its recovery.
	startupReminder = 5 * time.Minute
)

// pgGroup is the start of a config's Postgres stores (startup.Group).
type pgGroup struct {
	stores []*Store
}

// Start starts the stores, and returns a channel closed once each has
// ended its first attempt.
func (g *pgGroup) Start() <-chan struct{} {
	g.quietFollowers()
	for _, s := range g.stores {
		s.start.begin(s)
	}
	tried := make(chan struct{})
	go func() {
		defer close(tried)
		for _, s := range g.stores {
			<-s.start.tried
		}
	}()
	return tried
}

// quietFollowers makes the stores of several handlers that share one
// table (its database and name) log their start as one store: the first
// of them logs the start's lines, and the others, which start alike,
// keep quiet. So that they do start alike, each reads the table's
// credential secret if any of them hashes under it. Their failed
// attempts are still counted, each on its own server's metrics.
func (g *pgGroup) quietFollowers() {
	leaders := map[string]*Store{}
	for _, s := range g.stores {
		if l, ok := leaders[s.Records()]; ok {
			s.start.quiet = true
			l.tableSecret = l.tableSecret || s.tableSecret
			continue
		}
		leaders[s.Records()] = s
	}
	for _, s := range g.stores {
		s.tableSecret = s.tableSecret || leaders[s.Records()].tableSecret
	}
}

// startState is the state of one store's start.
type startState struct {
	// ctx is the config's, cancelled when it unloads, and by Cleanup.
	ctx  context.Context
	stop context.CancelFunc
	once sync.Once
	// tried is closed once the first attempt has ended, ready once the
	// store may serve.
	tried, ready chan struct{}

	mu  sync.Mutex
	err error // of the latest attempt, until one succeeds

	// secret is the table's credential secret, read if a handler hashes
	// under it (tableSecret) before ready is closed.
	secret []byte

	// errors counts the failed attempts, on the HTTP server of the
	// handler whose store this is.
	errors store.Counter

	// quiet is set on a store whose table another store of the config
	// starts too, which logs the start for both (quietFollowers).
	quiet bool
}

// startStore sets up the start of s: by the startup app of ctx's config,
// or, for a store provisioned outside a config (a program's, a test's),
// at its first use.
func startStore(ctx caddy.Context, s *Store) error {
	sctx, stop := context.WithCancel(ctx)
	s.start = &startState{ctx: sctx, stop: stop, tried: make(chan struct{}), ready: make(chan struct{})}
	g, _, err := startup.Join(ctx, "postgres", func() startup.Group { return new(pgGroup) })
	if g != nil {
		g.(*pgGroup).stores = append(g.(*pgGroup).stores, s)
	}
	return err
}

// CountFailedStarts implements store.StartCounter.
func (s *Store) CountFailedStarts(c store.Counter) { s.start.errors = c }

// begin starts the attempts of s, once.
func (st *startState) begin(s *Store) {
	st.once.Do(func() { go s.startLoop() })
}

// Ready returns nil once s may serve. Before its first attempt has ended,
// it waits for it as long as ctx lets it; after a failed one, it returns
// that failure at once: a request waits for the start of a store, not
// for the end of an outage.
func (s *Store) Ready(ctx context.Context) error {
	st := s.start
	select {
	case <-st.ready:
		return nil
	default:
	}
	st.begin(s)
	select {
	case <-st.ready:
		return nil
	case <-st.tried:
	case <-ctx.Done():
		return fmt.Errorf("postgres store: starting: %w", ctx.Err())
	}
	select {
	case <-st.ready:
		return nil
	default:
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return fmt.Errorf("postgres store: not started yet, retrying in the background: %w", st.err)
}

// startLoop attempts to start s until it succeeds or its config unloads,
// with a backoff. An outage is logged when it is found, at most once per
// startupReminder while it lasts, and when it ends; every failed attempt
// is counted.
func (s *Store) startLoop() {
	st := s.start
	table := zap.String("table", s.table.String())
	var failures int
	var since, reminded time.Time
	for backoff := startupBackoff; ; backoff = min(2*backoff, startupMaxBackoff) {
		err := s.prepare(st.ctx)
		if err == nil {
			close(st.ready)
		} else {
			st.mu.Lock()
			st.err = err
			st.mu.Unlock()
			s.nameExecMode(err)
		}
		if failures == 0 {
			close(st.tried)
		}
		if st.ctx.Err() != nil {
			return
		}
		if err == nil {
			if failures > 0 && !st.quiet {
				s.logger.Info("postgres store started", table,
					zap.Int("failed_attempts", failures), zap.Duration("after", time.Since(since)))
			}
			warnAsyncReplication(st.ctx, s.pool, s.logger)
			return
		}
		failures++
		if st.errors != nil {
			st.errors.Inc()
		}
		switch now := time.Now(); {
		case st.quiet:
		case failures == 1:
			since, reminded = now, now
			s.logger.Error("postgres store cannot start: its protected requests answer 503 until it does; retrying in the background",
				table, zap.Error(err))
		case now.Sub(reminded) >= startupReminder:
			reminded = now
			s.logger.Warn("postgres store still cannot start: its protected requests answer 503", table,
				zap.Int("failed_attempts", failures), zap.Duration("for", now.Sub(since)), zap.Error(err))
		}
		select {
		case <-st.ctx.Done():
			return
		case <-time.After(backoff):
		}
	}
}

// prepare applies the migrations, unless `migrate off`, and reads the
// table's credential secret if a handler hashes under it.
func (s *Store) prepare(ctx context.Context) error {
	if s.Migrate == nil || *s.Migrate {
		n, err := Migrate(ctx, s.pool, s.table.String())
		if err != nil {
			return err
		}
		if n > 0 { // under the migrations' lock, one store of a table applies them
			s.logger.Info("applied schema migrations", zap.String("table", s.table.String()), zap.Int("count", n))
		}
	}
	if s.tableSecret {
		secret, err := s.readCredentialSecret(ctx)
		if err != nil {
			return err
		}
		s.start.secret = secret
	}
	return nil
}
