package memory

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/startup"
	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(Store{})
}

const defaultMemoryMaxEntries = 100_000

// memoryPool shares the process's one set of memory records between the
// handlers that use it, across config reloads: Caddy provisions the new
// config before it cleans up the old one, so the reference count stays
// above zero and the records survive, whatever max_entries the new
// config gives.
var memoryPool = caddy.NewUsagePool()

// memoryPoolKey names the records in memoryPool: one set per process, so
// that a reload that changes max_entries does not start an empty store
// (and execute completed keys again).
const memoryPoolKey = "memory"

// Store keeps records in the memory of the Caddy process. It is
// the default store, for development, demos and tests: records are lost
// when the process exits and are not shared with other instances, so
// retries that reach another instance, or come after a restart, execute
// again. Use the postgres store in production.
type Store struct {
	// MaxEntries bounds the number of records kept. When the store is
	// full of live records, a request with a new key gets 503 rather than
	// evicting a live record, which would let that record's retry execute
	// twice. Memory use is bounded by MaxEntries times the handler's
	// max_response_body. The records, and so the cap, are shared by every
	// memory store in the process (every site); the one provisioned last
	// sets the cap. Default: 100000.
	MaxEntries int `json:"max_entries,omitempty"`

	records *memoryRecords
	poolKey string
}

// New returns a memory store with records of its own, rather than the
// process's shared ones, and the clock now (time.Now if nil): for a
// program or a test that uses a store outside a Caddy config.
func New(maxEntries int, now func() time.Time) *Store {
	if now == nil {
		now = time.Now
	}
	return &Store{MaxEntries: maxEntries, records: newMemoryRecords(maxEntries, now)}
}

// CaddyModule returns the Caddy module information.
func (Store) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.idempotency.stores.memory",
		New: func() caddy.Module { return new(Store) },
	}
}

// Provision attaches the store to the records shared by every memory
// store, and makes MaxEntries their cap: the config provisioned last
// sets it for all.
func (m *Store) Provision(ctx caddy.Context) error {
	if m.MaxEntries < 0 {
		return fmt.Errorf("max_entries must be positive, got %d", m.MaxEntries)
	}
	if m.MaxEntries == 0 {
		m.MaxEntries = defaultMemoryMaxEntries
	}
	if warn, err := memoryWarns(ctx); err != nil {
		return err
	} else if warn {
		ctx.Logger().Warn("the memory store is not durable: records are lost when Caddy exits and are not shared with other instances; use the postgres store in production",
			zap.Int("max_entries", m.MaxEntries))
	}

	v, _, err := memoryPool.LoadOrNew(memoryPoolKey, func() (caddy.Destructor, error) {
		return newMemoryRecords(m.MaxEntries, time.Now), nil
	})
	if err != nil {
		return err
	}
	m.records, m.poolKey = v.(*memoryRecords), memoryPoolKey
	// A smaller cap than the records held refuses new keys until enough
	// expire; no live record is evicted.
	m.records.mu.Lock()
	m.records.maxEntries = m.MaxEntries
	m.records.mu.Unlock()
	return nil
}

// memoryWarns reports whether the memory store that ctx provisions is the
// first of its config, the one to say that the store is not durable:
// every memory store of a process shares one set of records, so one
// warning is the store's, not each handler's. A store provisioned
// outside a config always says so.
func memoryWarns(ctx caddy.Context) (bool, error) {
	_, first, err := startup.Join(ctx, "memory", func() startup.Group { return started{} })
	return first, err
}

// started is the memory stores' group: they start as they are
// provisioned.
type started struct{}

func (started) Start() <-chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}

// Cleanup releases this configuration's reference to the records.
func (m *Store) Cleanup() error {
	if m.poolKey == "" {
		return nil
	}
	_, err := memoryPool.Delete(m.poolKey)
	return err
}

// Acquire implements Store.
func (m *Store) Acquire(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	if err := ctx.Err(); err != nil {
		return store.AcquireResult{}, err
	}
	res, packed, err := m.records.acquire(req)
	if res.Record != nil && res.Record.Status == store.StatusCompleted {
		// A packed response is never changed once stored, so it is
		// unpacked outside the lock.
		var uerr error
		if res.Record.Response, uerr = packed.unpack(); uerr != nil {
			return store.AcquireResult{}, fmt.Errorf("memory store: %w: %w", store.ErrRecordUnreadable, uerr)
		}
	}
	return res, err
}

// Complete implements Store.
func (m *Store) Complete(ctx context.Context, key store.RecordKey, token store.LockToken, resp *store.Response, retention time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	// Packed outside the lock.
	packed := packResponse(resp)
	err := m.records.owned(key, token, func(rec *memoryRecord) {
		rec.Status = store.StatusCompleted
		rec.response = packed
		// Later than the expiry it replaces (that of the record's
		// acquire or last renewal, both before now), so earliest stays
		// a lower bound.
		rec.ExpiresAt = m.records.now().Add(retention)
	})
	if errors.Is(err, store.ErrLockLost) && m.records.completedBy(key, token) {
		return nil
	}
	if err == nil {
		m.records.waits.Wake(key)
	}
	return err
}

// Release implements Store.
func (m *Store) Release(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	err := m.records.owned(key, token, func(*memoryRecord) {
		delete(m.records.m, key)
	})
	if errors.Is(err, store.ErrLockLost) && m.records.gone(key) {
		return nil
	}
	if err == nil {
		m.records.waits.Wake(key)
	}
	return err
}

// EnableWaiting implements Waiter. The memory store always wakes
// waiters: with none, that costs a map lookup.
func (m *Store) EnableWaiting() error { return nil }

// WaitCompleted implements Waiter.
func (m *Store) WaitCompleted(ctx context.Context, key store.RecordKey) <-chan struct{} {
	return m.records.waits.Wait(ctx, key)
}

// Renew implements Store.
func (m *Store) Renew(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	// A lease that has ended is not renewed: from then on a retry or an
	// operator may take the record (leaseEnded).
	ended := false
	err := m.records.owned(key, token, func(rec *memoryRecord) {
		now := m.records.now()
		if ended = rec.leaseEnded(now); ended {
			return
		}
		rec.LockedAt, rec.LockedUntil = now, now.Add(rec.lease)
		// The record must outlive its lease; a later expiry keeps
		// earliest a lower bound.
		if rec.ExpiresAt.Before(rec.LockedUntil) {
			rec.ExpiresAt = rec.LockedUntil
		}
	})
	if ended {
		return store.ErrLockLost
	}
	return err
}

// Prune implements Store. It holds the lock for one batch at a time, so
// that requests are not stalled while a large store is swept.
func (m *Store) Prune(ctx context.Context, batchSize int) (int64, error) {
	s := m.records
	// Old and new configs share the records during a reload; one
	// sweeper is enough.
	if !s.pruning.CompareAndSwap(false, true) {
		return 0, nil
	}
	defer s.pruning.Store(false)
	var total int64
	for {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		s.mu.Lock()
		n := s.dropExpired(s.now(), batchSize)
		s.mu.Unlock()
		total += int64(n)
		if batchSize <= 0 || n < batchSize {
			return total, nil
		}
	}
}

// memoryRecords is the state a Store shares through memoryPool.
type memoryRecords struct {
	now        func() time.Time
	maxEntries int
	pruning    atomic.Bool

	mu sync.Mutex
	m  map[store.RecordKey]*memoryRecord
	// earliest is at or before the expiry of every record, so that a
	// full store of live records refuses a new key without sweeping the
	// whole map each time.
	earliest time.Time

	// waits are the requests waiting for a record to be completed or
	// released (the handler's `wait`).
	waits store.WaitSet[store.RecordKey]
}

// memoryRecord is a record as the memory store keeps it: its Response
// is always nil, the completed response being kept packed instead.
type memoryRecord struct {
	store.Record
	token store.LockToken
	// lease is the lock timeout of the record's owner: each renewal
	// extends LockedUntil to now plus lease.
	lease    time.Duration
	response packedResponse
}

// leaseEnded is "the owner is gone", the one rule of a takeover, a
// renewal and a non-forced release alike: the lease of the in-progress
// record has run out.
func (rec *memoryRecord) leaseEnded(now time.Time) bool { return !now.Before(rec.LockedUntil) }

func newMemoryRecords(maxEntries int, now func() time.Time) *memoryRecords {
	return &memoryRecords{now: now, maxEntries: maxEntries, m: make(map[store.RecordKey]*memoryRecord)}
}

func (s *memoryRecords) acquire(req store.AcquireRequest) (store.AcquireResult, packedResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	rec, ok := s.m[req.Key]
	// An in_progress record outlives its lease (Renew), so a live lease
	// is never expired.
	if ok && !now.Before(rec.ExpiresAt) {
		delete(s.m, req.Key)
		ok = false
	}
	if !ok {
		if len(s.m) >= s.maxEntries && !now.Before(s.earliest) {
			s.dropExpired(now, 0)
		}
		if len(s.m) >= s.maxEntries {
			return store.AcquireResult{}, packedResponse{}, store.ErrStoreFull
		}
		rec = &memoryRecord{token: req.Token, lease: req.LockTimeout, Record: store.Record{
			Status:      store.StatusInProgress,
			Fingerprint: req.Fingerprint,
			Method:      req.Method,
			Path:        req.Path,
			CreatedAt:   now,
			ExpiresAt:   now.Add(max(req.Retention, req.LockTimeout)),
			LockedAt:    now,
			LockedUntil: now.Add(req.LockTimeout),
		}}
		s.m[req.Key] = rec
		if len(s.m) == 1 || rec.ExpiresAt.Before(s.earliest) {
			s.earliest = rec.ExpiresAt
		}
		return store.AcquireResult{Outcome: store.OutcomeCreated}, packedResponse{}, nil
	}
	if rec.token == req.Token && rec.Status == store.StatusInProgress && !rec.leaseEnded(now) {
		// The Store contract: an earlier attempt of this acquire.
		return store.AcquireResult{Outcome: store.OutcomeCreated}, packedResponse{}, nil
	}
	// Only the same request may take over a stale lock: a different one
	// under the same key must get its mismatch, not run in place of a
	// request that may have executed. The lease is the record's, set by
	// its owner's lock timeout, not the retrier's.
	if rec.Status == store.StatusInProgress && rec.leaseEnded(now) && rec.Fingerprint == req.Fingerprint {
		// A fresh retention, as the Postgres store gives: a record that
		// expired under its new owner would let yet another request run.
		rec.token, rec.lease = req.Token, req.LockTimeout
		rec.LockedAt, rec.LockedUntil = now, now.Add(req.LockTimeout)
		rec.ExpiresAt = now.Add(max(req.Retention, req.LockTimeout))
		return store.AcquireResult{Outcome: store.OutcomeTakenOver}, packedResponse{}, nil
	}
	snapshot := rec.Record
	snapshot.TTL = rec.ExpiresAt.Sub(now)
	return store.AcquireResult{Outcome: store.OutcomeExisting, Record: &snapshot}, rec.response, nil
}

// owned runs f on the in_progress record of key if token owns it, under
// the lock, or returns ErrLockLost.
func (s *memoryRecords) owned(key store.RecordKey, token store.LockToken, f func(*memoryRecord)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.m[key]
	if !ok || rec.token != token || rec.Status != store.StatusInProgress {
		return store.ErrLockLost
	}
	f(rec)
	return nil
}

// completedBy reports whether token completed the record of key.
func (s *memoryRecords) completedBy(key store.RecordKey, token store.LockToken) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.m[key]
	return ok && rec.token == token && rec.Status == store.StatusCompleted
}

// gone reports whether key has no record.
func (s *memoryRecords) gone(key store.RecordKey) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.m[key]
	return !ok
}

// dropExpired deletes up to limit (all if limit <= 0) expired records and
// returns how many it deleted; s.mu must be held.
func (s *memoryRecords) dropExpired(now time.Time, limit int) int {
	var n int
	var earliest time.Time
	for key, rec := range s.m {
		if !now.Before(rec.ExpiresAt) {
			delete(s.m, key)
			if n++; n == limit {
				// The sweep stopped early: earliest stays a lower bound.
				return n
			}
		} else if earliest.IsZero() || rec.ExpiresAt.Before(earliest) {
			earliest = rec.ExpiresAt
		}
	}
	s.earliest = earliest
	return n
}

// Destruct implements caddy.Destructor: the records are dropped with the
// last configuration that used them.
func (s *memoryRecords) Destruct() error {
	return nil
}

// packedResponse is a completed response as the memory store keeps it:
// its headers in one allocation that holds no pointers, and its body as
// the caller recorded it. A store of many records then costs the garbage
// collector two small objects to mark per record instead of a header
// map, its slices and strings, which with a large store was most of a
// first execution's collection cost.
type packedResponse struct {
	status             int
	replayable, sealed bool
	bodySize           int64
	// headers is as store.EncodeHeaders encodes them, nil for none.
	headers []byte
	// body is the recorded body itself, not a copy (Store.Complete: the
	// caller gives it up), so that a first execution allocates its
	// response body once, in the recorder. Neither is ever changed once
	// stored.
	body []byte
}

// packResponse packs r's headers, as the Postgres store encodes them
// too, and keeps its body.
func packResponse(r *store.Response) packedResponse {
	p := packedResponse{status: r.Status, replayable: r.Replayable, sealed: r.Sealed, bodySize: r.BodySize, body: store.KeptBody(r.Body)}
	if len(r.Header) > 0 {
		p.headers = store.EncodeHeaders(r.Header)
	}
	return p
}

// unpack returns the Response that p packed. The body is the store's
// own, never changed once stored, so it is shared rather than copied: a
// replay of a large body would otherwise copy all of it to write it once.
func (p packedResponse) unpack() (*store.Response, error) {
	r := &store.Response{Status: p.status, Replayable: p.replayable, Sealed: p.sealed, BodySize: p.bodySize}
	if p.body != nil {
		// Capacity ends at the body's end: an append reallocates.
		r.Body = p.body[:len(p.body):len(p.body)]
	}
	if p.headers == nil && !p.sealed {
		// As a store's answer has it: a map, if an empty one.
		r.Header = http.Header{}
		return r, nil
	}
	if p.sealed {
		return r, nil
	}
	var err error
	r.Header, err = store.DecodeHeaders(p.headers)
	return r, err
}

// Records implements RecordSet: one set per process (memoryPool).
func (m *Store) Records() string { return memoryPoolKey }

// InProcess implements InProcess.
func (m *Store) InProcess() {}

// Interface guards
var (
	_ store.Store           = (*Store)(nil)
	_ store.Waiter          = (*Store)(nil)
	_ store.SecretKeeper    = (*Store)(nil)
	_ store.RecordSet       = (*Store)(nil)
	_ store.InProcess       = (*Store)(nil)
	_ caddy.Provisioner     = (*Store)(nil)
	_ caddy.CleanerUpper    = (*Store)(nil)
	_ caddyfile.Unmarshaler = (*Store)(nil)
	_ caddy.Destructor      = (*memoryRecords)(nil)
)

// UnmarshalCaddyfile sets up the store from Caddyfile tokens. Syntax:
//
//	memory {
//		max_entries <n>
//	}
func (m *Store) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the backend name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("memory store: %s given more than once", opt)
		}
		seen[opt] = true
		switch opt {
		case "max_entries":
			if !d.NextArg() {
				return d.ArgErr()
			}
			n, err := strconv.Atoi(d.Val())
			if err != nil || n <= 0 {
				return d.Errf("max_entries must be a positive integer, got %q", d.Val())
			}
			if d.NextArg() {
				return d.ArgErr()
			}
			m.MaxEntries = n
		default:
			return d.Errf("unrecognized memory store option %q", d.Val())
		}
	}
	return nil
}

// memorySecret is the memory store's secret: its records live in this
// process only, so a random secret of the process is shared by all of
// them, across config reloads.
var memorySecret = sync.OnceValue(func() []byte {
	secret := make([]byte, store.MinSecretLen)
	_, _ = rand.Read(secret) // crypto/rand.Read never returns an error
	return secret
})

// UseCredentialSecret implements SecretKeeper: the secret is the
// process's, at hand.
func (m *Store) UseCredentialSecret() {}

// CredentialSecret implements SecretKeeper.
func (m *Store) CredentialSecret(context.Context) ([]byte, error) {
	return memorySecret(), nil
}
