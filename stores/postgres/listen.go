package postgres

// Waiting with Postgres: a completion or release sends a NOTIFY in the
// same statement (so it stays one round trip, and the notification is
// delivered at commit, never before the record can be read), and each
// Caddy instance keeps one LISTEN connection per DSN that wakes its
// waiters.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/errlog"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
)

// pgListeners holds one listener per DSN, shared by every store that
// waits and kept across config reloads by reference counting, as
// postgresPools does for pools.
var pgListeners = caddy.NewUsagePool()

const (
	// listenerPing is how long the listener waits for a notification
	// before it checks that its connection is alive: a server that
	// vanished without closing the socket would otherwise leave it
	// waiting forever while notifications go elsewhere.
	listenerPing = 30 * time.Second
	// listenerMaxBackoff caps the delay between reconnection attempts.
	listenerMaxBackoff = 30 * time.Second
)

// EnableWaiting implements Waiter: from now on Complete and Release send
// a NOTIFY on the table's channel, and this instance listens to it. It is
// opt-in because a NOTIFY takes a database-wide lock at commit, which
// serialises the commits of concurrent completions.
//
// The LISTEN connection is listen_dsn's, or else dsn's. A LISTEN lives
// on its session, which a transaction pooler does not give a client: a
// pooled dsn (pooledDSN) without listen_dsn is refused, since its
// waiters would never be woken.
func (s *Store) EnableWaiting() error {
	if s.listener != nil {
		return nil
	}
	var cfg *pgx.ConnConfig
	dsn := s.poolKey.dsn
	if s.ListenDSN != "" {
		dsn = caddy.NewReplacer().ReplaceKnown(s.ListenDSN, "")
		c, err := pgx.ParseConfig(dsn)
		if err != nil {
			// pgx's parse errors quote the DSN, password included.
			return errors.New("postgres store: listen_dsn is not a valid connection string")
		}
		if err := directListenDSN(c, s.pool.Config().ConnConfig); err != nil {
			return err
		}
		cfg = c
	} else {
		cfg = s.pool.Config().ConnConfig.Copy()
		if pooledDSN(cfg) {
			return fmt.Errorf("postgres store: dsn asks for default_query_exec_mode=%s, so it is taken to go through a transaction pooler, which cannot carry the LISTEN that wait needs: set listen_dsn to a direct connection to the database", cfg.DefaultQueryExecMode)
		}
	}
	cfg.RuntimeParams["application_name"] = "caddy-idempotency-listener"
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = 10 * time.Second
	}
	// The constructor cannot fail.
	val, _, _ := pgListeners.LoadOrNew(dsn, func() (caddy.Destructor, error) {
		return newPGListener(cfg), nil
	})
	s.listener = val.(*pgListener)
	s.listenKey = dsn
	s.channel = notifyChannel(s.table)
	s.listener.subscribe(s.channel)
	s.sql.complete = completeSQL(s.table, true)
	s.sql.release = releaseSQL(s.table, true)
	return nil
}

// directListenDSN refuses a listen_dsn that the store can tell goes
// through a transaction pooler: one in a pooled exec mode, or one on the
// host and port of a pooled dsn. Its LISTEN would land on a server
// connection that the pooler hands to other clients, and waiters would
// answer only at their deadline, with nothing to say why.
func directListenDSN(listen, st *pgx.ConnConfig) error {
	if pooledDSN(listen) {
		return fmt.Errorf("postgres store: listen_dsn asks for default_query_exec_mode=%s, so it is taken to go through a transaction pooler, which cannot carry the LISTEN that wait needs: give listen_dsn a direct connection to the database, in pgx's default mode", listen.DefaultQueryExecMode)
	}
	if !pooledDSN(st) {
		return nil
	}
	for _, l := range endpoints(listen) {
		for _, d := range endpoints(st) {
			if l.port == d.port && sameHost(l.host, d.host) {
				return fmt.Errorf("postgres store: listen_dsn names the host and port of dsn (%s:%d), which goes through a transaction pooler and cannot carry the LISTEN that wait needs: give listen_dsn a direct connection to the database", l.host, l.port)
			}
		}
	}
	return nil
}

type endpoint struct {
	host string
	port uint16
}

// endpoints are the hosts and ports that cfg may connect to, its
// fallbacks (a multi-host DSN) included.
func endpoints(cfg *pgx.ConnConfig) []endpoint {
	e := []endpoint{{cfg.Host, cfg.Port}}
	for _, f := range cfg.Fallbacks {
		e = append(e, endpoint{f.Host, f.Port})
	}
	return e
}

// sameHost reports whether a and b name the same host as far as the
// configuration shows, without a DNS lookup: the same name, or two names
// of this machine (localhost, the loopback addresses, and 0.0.0.0 or ::,
// which a client reaches this machine by), where a pooler next to Caddy
// usually listens.
func sameHost(a, b string) bool {
	thisMachine := func(h string) bool {
		if strings.EqualFold(h, "localhost") {
			return true
		}
		ip := net.ParseIP(h)
		return ip != nil && (ip.IsLoopback() || ip.IsUnspecified())
	}
	return strings.EqualFold(a, b) || thisMachine(a) && thisMachine(b)
}

// WaitCompleted implements Waiter.
func (s *Store) WaitCompleted(ctx context.Context, key store.RecordKey) <-chan struct{} {
	return s.listener.waits.Wait(ctx, pgWaitKey{s.channel, notifyPayload(key)})
}

// stopWaiting gives back this store's share of its listener.
func (s *Store) stopWaiting() {
	if s.listener == nil {
		return
	}
	s.listener.unsubscribe(s.channel)
	_, _ = pgListeners.Delete(s.listenKey) // only a missing key errs
}

// notifyChannel is the NOTIFY channel of a table. A hash keeps it within
// the 63 bytes of an identifier whatever the table's name.
func notifyChannel(t Table) string {
	h := fnv.New64a()
	h.Write([]byte(t.String()))
	return fmt.Sprintf("idempotency_%016x", h.Sum64())
}

// notifyPayload names a record in a notification without revealing its
// key: NOTIFY payloads are visible to every listener of the database.
func notifyPayload(key store.RecordKey) string {
	h := sha256.New()
	h.Write(key.CredentialHash[:])
	h.Write([]byte(key.Key))
	return hex.EncodeToString(h.Sum(nil))
}

type pgWaitKey struct{ channel, payload string }

// pgListener is one LISTEN connection and the waiters it wakes. It
// reconnects, with backoff, whenever the connection fails; since
// notifications sent meanwhile are lost, every waiter is woken once it
// listens again, to look at its record.
type pgListener struct {
	config *pgx.ConnConfig
	waits  store.WaitSet[pgWaitKey]
	stop   context.CancelFunc
	done   chan struct{}

	mu       sync.Mutex
	channels map[string]int // channel → subscribed stores
	// changed is closed, and replaced, when channels changes, so that
	// the connection LISTENs to the new set.
	changed chan struct{}

	// errorLines limits the listener's store_error lines, as a
	// handler's are for each operation (storelog.go).
	errorLines errlog.Limiter
}

func newPGListener(cfg *pgx.ConnConfig) *pgListener {
	ctx, cancel := context.WithCancel(context.Background())
	l := &pgListener{
		config:   cfg,
		stop:     cancel,
		done:     make(chan struct{}),
		channels: make(map[string]int),
		changed:  make(chan struct{}),
	}
	go l.run(ctx)
	return l
}

// Destruct implements caddy.Destructor: the last store is gone.
func (l *pgListener) Destruct() error {
	l.stop()
	<-l.done
	l.waits.WakeAll()
	return nil
}

func (l *pgListener) subscribe(channel string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.channels[channel]++
	l.signalChangeLocked()
}

func (l *pgListener) unsubscribe(channel string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.channels[channel]--; l.channels[channel] <= 0 {
		delete(l.channels, channel)
	}
	l.signalChangeLocked()
}

func (l *pgListener) signalChangeLocked() {
	close(l.changed)
	l.changed = make(chan struct{})
}

// wanted returns the channels to listen to, and the signal of their next
// change.
func (l *pgListener) wanted() (map[string]bool, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	set := make(map[string]bool, len(l.channels))
	for ch := range l.channels {
		set[ch] = true
	}
	return set, l.changed
}

func (l *pgListener) run(ctx context.Context) {
	defer close(l.done)
	backoff := 100 * time.Millisecond
	for {
		connected, err := l.session(ctx)
		if ctx.Err() != nil {
			return
		}
		if connected {
			backoff = 100 * time.Millisecond
		}
		// A connection that listens and is lost again within a second
		// (a flapping link) writes no second line in that second: the
		// limiter is not reset as the connection comes back.
		if ok, suppressed := l.errorLines.Allow(errlog.Now()); ok {
			caddy.Log().Named("http.handlers.idempotency.stores.postgres").Error("idempotency.store_error",
				errlog.Fields("listen", err, suppressed, zap.Duration("retry_in", backoff))...)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, listenerMaxBackoff)
	}
}

// session runs one connection until it fails, and reports whether it
// got as far as listening.
func (l *pgListener) session(ctx context.Context) (connected bool, err error) {
	conn, err := pgx.ConnectConfig(ctx, l.config)
	if err != nil {
		return false, err
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	listening := make(map[string]bool)
	for {
		want, changed := l.wanted()
		added := make(map[string]bool)
		for ch := range want {
			if !listening[ch] {
				if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize()); err != nil {
					return connected, err
				}
				listening[ch] = true
				added[ch] = true
			}
		}
		for ch := range listening {
			if !want[ch] {
				if _, err := conn.Exec(ctx, "UNLISTEN "+pgx.Identifier{ch}.Sanitize()); err != nil {
					return connected, err
				}
				delete(listening, ch)
			}
		}
		// Completions while this connection was not listening went
		// unheard: every waiter looks again. Later, when the stores
		// sharing the listener change, only the waiters of the channels
		// just listened to: another store's coming or going changes
		// nothing for the rest, whose waiters would otherwise all wake
		// and ask their store again.
		if !connected {
			l.waits.WakeAll()
		} else if len(added) > 0 {
			l.waits.WakeWhere(func(k pgWaitKey) bool { return added[k.channel] })
		}
		connected = true
		if err := l.receive(ctx, conn, changed); err != nil {
			return connected, err
		}
	}
}

// receive wakes waiters as notifications arrive, until the channel set
// changes (it returns nil) or the connection fails.
func (l *pgListener) receive(ctx context.Context, conn *pgx.Conn, changed <-chan struct{}) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-changed:
			cancel()
		case <-sctx.Done():
		}
	}()
	for {
		wctx, wcancel := context.WithTimeout(sctx, listenerPing)
		n, err := conn.WaitForNotification(wctx)
		wcancel()
		switch {
		case err == nil:
			l.waits.Wake(pgWaitKey{n.Channel, n.Payload})
		case sctx.Err() != nil:
			return ctx.Err()
		case pgconn.Timeout(err):
			pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
			err := conn.Ping(pctx)
			pcancel()
			if err != nil {
				return err
			}
		default:
			return err
		}
	}
}

// Interface guards
var (
	_ store.Waiter     = (*Store)(nil)
	_ caddy.Destructor = (*pgListener)(nil)
)
