package idempotency

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

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(startupApp{})
}

// The delays between a store's attempts to start: doubling from the
// first to the last, which they then keep until the database answers.
const (
	startupBackoff    = 100 * time.Millisecond
	startupMaxBackoff = 5 * time.Second
	// startupReminder is how often a store that still cannot start says
	// so again, between its first failure and its recovery.
	startupReminder = 5 * time.Minute
)

// startupApp starts the Postgres stores of a config once Caddy runs it.
// Caddy provisions a config to validate it too (`caddy validate`, `caddy
// adapt --validate`, caddy.Validate), and then cancels it; it starts the
// apps only of a config it runs. The stores ask for this app (ctx.App, as
// the http app does for tls), so no config names it, and it has no
// settings.
type startupApp struct {
	stores []*PostgresStore
	// memoryWarned is set once a memory store of the config has said
	// that it is not durable: every memory store of a process shares one
	// set of records, so one warning is the store's, not each handler's.
	memoryWarned bool
}

// CaddyModule returns the Caddy module information.
func (startupApp) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "idempotency",
		New: func() caddy.Module { return new(startupApp) },
	}
}

// Start starts the stores and waits, for at most one store timeout, for
// their first attempts: with the database up, a config is running with
// its tables migrated once it has loaded, and its first requests get no
// 503; with the database down, Caddy starts all the same.
func (a *startupApp) Start() error {
	a.quietFollowers()
	for _, s := range a.stores {
		s.start.begin(s)
	}
	timeout := time.NewTimer(storeTimeout)
	defer timeout.Stop()
	for _, s := range a.stores {
		select {
		case <-s.start.tried:
		case <-timeout.C:
			return nil
		}
	}
	return nil
}

// quietFollowers makes the stores of several handlers that share one
// table (its database and name) log their start as one store: the first
// of them logs the start's lines, and the others, which start alike,
// keep quiet. So that they do start alike, each reads the table's
// credential secret if any of them hashes under it. Their failed
// attempts are still counted, each on its own server's metrics.
func (a *startupApp) quietFollowers() {
	leaders := map[string]*PostgresStore{}
	for _, s := range a.stores {
		if l, ok := leaders[s.Records()]; ok {
			s.start.quiet = true
			l.tableSecret = l.tableSecret || s.tableSecret
			continue
		}
		leaders[s.Records()] = s
	}
	for _, s := range a.stores {
		s.tableSecret = s.tableSecret || leaders[s.Records()].tableSecret
	}
}

// warnMemory reports whether a memory store of this config is the first
// to warn that it is not durable.
func (a *startupApp) warnMemory() bool {
	first := !a.memoryWarned
	a.memoryWarned = true
	return first
}

// Stop does nothing: the stores' attempts end with the config's context.
func (a *startupApp) Stop() error { return nil }

// startup is the state of one store's start.
type startup struct {
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
	errors prometheus.Counter

	// quiet is set on a store whose table another store of the config
	// starts too, which logs the start for both (quietFollowers).
	quiet bool
}

// startStore sets up the start of s: by the app of ctx's config, or, for
// a store provisioned outside a config (a program's, a test's), at its
// first use.
func startStore(ctx caddy.Context, s *PostgresStore) error {
	sctx, stop := context.WithCancel(ctx)
	s.start = &startup{ctx: sctx, stop: stop, tried: make(chan struct{}), ready: make(chan struct{}), errors: startupErrors(ctx)}
	if !inConfig(ctx) {
		return nil
	}
	app, err := ctx.App("idempotency")
	if err != nil {
		return err
	}
	a := app.(*startupApp)
	a.stores = append(a.stores, s)
	return nil
}

// inConfig reports whether ctx provisions a module of a config's app: the
// app is the first of the modules it provisioned. Only then is there an
// app to ask for, and a Start to wait for.
func inConfig(ctx caddy.Context) bool {
	mods := ctx.Modules()
	if len(mods) == 0 {
		return false
	}
	_, ok := mods[0].(caddy.App)
	return ok
}

// begin starts the attempts of s, once.
func (st *startup) begin(s *PostgresStore) {
	st.once.Do(func() { go s.startLoop() })
}

// ready returns nil once s may serve. Before its first attempt has ended,
// it waits for it as long as ctx lets it; after a failed one, it returns
// that failure at once: a request waits for the start of a store, not
// for the end of an outage.
func (s *PostgresStore) ready(ctx context.Context) error {
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
func (s *PostgresStore) startLoop() {
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
		st.errors.Inc()
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
func (s *PostgresStore) prepare(ctx context.Context) error {
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

// Interface guards
var (
	_ caddy.App    = (*startupApp)(nil)
	_ caddy.Module = (*startupApp)(nil)
)
