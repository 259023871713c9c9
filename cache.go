package idempotency

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
)

// defaultReplayCache is the replay cache's size per handler. A recorded
// response is typically a few KiB, so 4 MiB keeps the last thousand or
// so replayable responses: enough for the retries that follow an outage
// or a deploy, which are what repeats keys, and little next to the
// per-request buffers (max_request_body and max_response_body, 1 MiB
// each) that the handler may already hold 64 at a time.
const defaultReplayCache = 4 << 20

// cacheMaxEntryShare: an entry larger than capacity/cacheMaxEntryShare
// is not cached, so that one large response cannot flush the rest.
const cacheMaxEntryShare = 16

// cacheEntryOverhead approximates what an entry costs besides its body,
// headers and key: the entry, its map slot, the Record and Response.
const cacheEntryOverhead = 320

// replayCache is a Store that keeps the most recently used completed,
// replayable records of the store it wraps, so that a replay costs no
// round trip. A completed record never changes until it expires (Acquire
// only takes over expired records and stale in-progress ones), so a copy
// is as good as the store's answer, until:
//
//   - it expires: entries are not served past the record's expiry, which
//     is computed conservatively, on this process's monotonic clock, from
//     lifetimes the store measured on its own clock (never by comparing
//     the two clocks, which need not agree);
//   - an operator deletes it (`caddy idempotency release`): this
//     instance's cache, like every other instance's, keeps replaying it
//     until it expires or is evicted. Releasing a completed key is for
//     support cases; restart or reload the instances if a deleted key
//     must execute again at once. The admin API's release (admin.go)
//     evicts it from the caches of its own process.
//
// Entries are keyed by RecordKey, that is by credential hash and key, so
// that one tenant never gets another's record. In-progress records are
// never cached: their answer changes when they complete.
//
// The cache learns a record either from Acquire, when the store returns
// a completed one, or from Complete of a record that this instance
// created: it remembers each Acquire that created a record, by lock
// token, until the record is completed, released or lost.
//
// Cached responses are shared between the requests that replay them and
// must not be modified; the handler only reads them.
type replayCache struct {
	store.Store
	// learnOnComplete: cache the responses of records this instance
	// completes, not only those read back from the store. Off in front
	// of the memory store, where the first replay is as cheap as the
	// store's own answer and copying every response would only tax
	// first executions.
	learnOnComplete bool
	capacity        int64
	// maxEntry is the largest entry kept: capacity/cacheMaxEntryShare.
	maxEntry int64
	now      func() time.Time

	mu      sync.Mutex
	entries map[store.RecordKey]*cacheEntry
	// lru is the sentinel of a circular list, most recently used first.
	lru  cacheEntry
	size int64

	pmu       sync.Mutex
	pending   map[store.LockToken]pendingRecord
	lastSweep time.Time
}

type cacheEntry struct {
	key store.RecordKey
	rec store.Record
	// deadline is when the entry stops being served, on the local clock
	// (with its monotonic reading): at or before the record's expiry.
	deadline   time.Time
	size       int64
	prev, next *cacheEntry
}

// pendingRecord is what the cache knows of a record this instance
// created and has not completed yet.
type pendingRecord struct {
	key         store.RecordKey
	fingerprint [32]byte
	method      string
	path        string
	// deadline is when the note is dropped if the request never
	// completes: the local time of the Acquire plus the retention.
	deadline time.Time
	created  time.Time
	// completing is when the first attempt to complete the record was
	// sent; zero before.
	completing time.Time
}

// newReplayCache wraps store in a cache of capacity bytes.
func newReplayCache(st store.Store, capacity int64) *replayCache {
	c := &replayCache{
		Store:           st,
		learnOnComplete: true,
		capacity:        capacity,
		maxEntry:        capacity / cacheMaxEntryShare,
		now:             time.Now,
		entries:         make(map[store.RecordKey]*cacheEntry),
		pending:         make(map[store.LockToken]pendingRecord),
	}
	c.lru.next, c.lru.prev = &c.lru, &c.lru
	return c
}

// Acquire implements Store: a live cached record is answered at once, as
// the store would answer it; anything else goes to the store.
func (c *replayCache) Acquire(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	now := c.now()
	if rec := c.get(req.Key, now); rec != nil {
		return store.AcquireResult{Outcome: store.OutcomeExisting, Record: rec}, nil
	}
	res, err := c.Store.Acquire(ctx, req)
	if err != nil {
		return res, err
	}
	switch res.Outcome {
	case store.OutcomeExisting:
		if rec := res.Record; rec != nil && rec.Status == store.StatusCompleted {
			// The store measured the record's remaining lifetime after
			// now, when the statement was sent: counted from now, the
			// entry ends no later than the record.
			c.put(req.Key, rec, now.Add(rec.TTL), now, false)
		}
	case store.OutcomeCreated:
		// A takeover is not remembered: whether it restarted the
		// record's expiry depends on the store.
		if c.learnOnComplete {
			c.remember(req, now)
		}
	}
	return res, err
}

// Complete implements Store, and caches the response of a record this
// instance created.
func (c *replayCache) Complete(ctx context.Context, key store.RecordKey, token store.LockToken, resp *store.Response, retention time.Duration) error {
	c.sending(token, c.now())
	err := c.Store.Complete(ctx, key, token, resp, retention)
	if err != nil && !errors.Is(err, store.ErrLockLost) {
		// The handler tries again: keep what a success will need.
		return err
	}
	p, ok := c.forget(token)
	if err != nil || !ok || p.key != key || resp == nil {
		return err
	}
	// The store makes the record expire retention after its own now,
	// at the attempt that completed it: this one, or an earlier one
	// whose reply was lost, which this one then found done. Either came
	// after the first attempt was sent.
	deadline := p.completing.Add(retention)
	rec := &store.Record{
		Status:      store.StatusCompleted,
		Fingerprint: p.fingerprint,
		Method:      p.method,
		Path:        p.path,
		CreatedAt:   p.created,
		ExpiresAt:   deadline,
		Response:    resp,
	}
	// The caller keeps its response: the cache keeps its own copy.
	c.put(key, rec, deadline, c.now(), true)
	return nil
}

// Release implements Store.
func (c *replayCache) Release(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	err := c.Store.Release(ctx, key, token)
	c.forget(token)
	return err
}

// RenewLocks implements LockRenewer: the locks lost are forgotten, as by
// Renew.
func (c *replayCache) RenewLocks(ctx context.Context, locks []store.HeldLock) []error {
	errs := renewLocks(ctx, c.Store, locks)
	for i, err := range errs {
		if errors.Is(err, store.ErrLockLost) {
			c.forget(locks[i].Token)
		}
	}
	return errs
}

// Renew implements Store: a lock lost is forgotten, since no completion
// under it will come.
func (c *replayCache) Renew(ctx context.Context, key store.RecordKey, token store.LockToken) error {
	err := c.Store.Renew(ctx, key, token)
	if errors.Is(err, store.ErrLockLost) {
		c.forget(token)
	}
	return err
}

// get returns a copy of the live entry of key, most recently used from
// now on, with its lifetime left, or nil.
func (c *replayCache) get(key store.RecordKey, now time.Time) *store.Record {
	c.mu.Lock()
	e := c.entries[key]
	if e == nil {
		c.mu.Unlock()
		return nil
	}
	if !now.Before(e.deadline) {
		c.remove(e)
		c.mu.Unlock()
		return nil
	}
	c.unlink(e)
	c.pushFront(e)
	rec := e.rec
	c.mu.Unlock()
	// What is left of the entry, which ends no later than the record:
	// the record's TTL as of this answer, as a store's answer has it.
	rec.TTL = e.deadline.Sub(now)
	return &rec
}

// put caches rec, a completed record, until deadline, if it is
// replayable and not too large, evicting the least recently used entries
// to make room. With given, rec's response is one that Complete was
// given, which the entry shares (cachedResponse).
func (c *replayCache) put(key store.RecordKey, rec *store.Record, deadline, now time.Time, given bool) {
	resp := rec.Response
	if rec.Status != store.StatusCompleted || resp == nil || !resp.Replayable || !now.Before(deadline) {
		return
	}
	size := cacheEntryOverhead + int64(len(key.Key)+len(rec.Method)+len(rec.Path)+len(resp.Body))
	for name, values := range resp.Header {
		size += int64(len(name))
		for _, v := range values {
			size += int64(len(v)) + 16
		}
	}
	if size > c.maxEntry {
		return
	}
	e := &cacheEntry{key: key, rec: *rec, deadline: deadline, size: size}
	if given {
		e.rec.Response = cachedResponse(resp)
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	if old := c.entries[key]; old != nil {
		c.remove(old)
	}
	c.entries[key] = e
	c.pushFront(e)
	c.size += size
	for c.size > c.capacity {
		c.remove(c.lru.prev)
	}
}

// remove drops e; c.mu must be held.
func (c *replayCache) remove(e *cacheEntry) {
	c.unlink(e)
	delete(c.entries, e.key)
	c.size -= e.size
}

func (c *replayCache) unlink(e *cacheEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
}

func (c *replayCache) pushFront(e *cacheEntry) {
	e.prev, e.next = &c.lru, c.lru.next
	c.lru.next.prev = e
	c.lru.next = e
}

// cacheSweepInterval is how often the pending records are swept of those
// whose requests never completed nor released them (a handler that
// panicked, a Complete that failed for good).
const cacheSweepInterval = time.Minute

// remember notes the record that req created, until it is completed.
func (c *replayCache) remember(req store.AcquireRequest, now time.Time) {
	p := pendingRecord{
		key:         req.Key,
		fingerprint: req.Fingerprint,
		method:      req.Method,
		path:        req.Path,
		deadline:    now.Add(req.Retention),
		created:     now,
	}
	c.pmu.Lock()
	defer c.pmu.Unlock()
	c.pending[req.Token] = p
	if now.Sub(c.lastSweep) >= cacheSweepInterval {
		c.lastSweep = now
		// A record past its expiry would not be cached anyway.
		for token, p := range c.pending {
			if !now.Before(p.deadline) {
				delete(c.pending, token)
			}
		}
	}
}

// sending notes that an attempt to complete the record of token is sent
// at now, unless an earlier one was.
func (c *replayCache) sending(token store.LockToken, now time.Time) {
	c.pmu.Lock()
	defer c.pmu.Unlock()
	if p, ok := c.pending[token]; ok && p.completing.IsZero() {
		p.completing = now
		c.pending[token] = p
	}
}

// forget drops and returns what remember noted for token.
func (c *replayCache) forget(token store.LockToken) (pendingRecord, bool) {
	c.pmu.Lock()
	defer c.pmu.Unlock()
	p, ok := c.pending[token]
	if ok {
		delete(c.pending, token)
	}
	return p, ok
}

// cachedResponse is resp as the cache keeps it: its body
// (store.KeptBody) and headers are shared, not copied, since the caller
// of Complete gives them up and nothing changes them once stored
// (Store.Complete).
func cachedResponse(resp *store.Response) *store.Response {
	c := *resp
	c.Body = store.KeptBody(resp.Body)
	if c.Body == nil {
		c.Body = []byte{}
	}
	if c.Header == nil {
		c.Header = http.Header{}
	}
	return &c
}

// Unwrap returns the store that c caches (store.As).
func (c *replayCache) Unwrap() store.Store { return c.Store }

// Interface guards
var (
	_ store.Store       = (*replayCache)(nil)
	_ store.LockRenewer = (*replayCache)(nil)
	_ store.Wrapper     = (*replayCache)(nil)
)
