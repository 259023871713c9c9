package idempotency

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/store/storetest"
	"github.com/caddy-idempotency/idempotency/stores/memory"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// cacheCountingStore counts the Acquires that reach the store under a cache.
type cacheCountingStore struct {
	store.Store
	acquires atomic.Int64
}

func (s *cacheCountingStore) Acquire(ctx context.Context, req store.AcquireRequest) (store.AcquireResult, error) {
	s.acquires.Add(1)
	return s.Store.Acquire(ctx, req)
}

// newCacheTest is a cache of capacity bytes over a memory store. The
// cache's clock and the store's are separate, as a Postgres's is.
func newCacheTest(capacity int64) (*replayCache, *cacheCountingStore, *storetest.Clock, *storetest.Clock) {
	mem, storeClock := newTestMemoryStore(1000)
	inner := &cacheCountingStore{Store: mem}
	c := newReplayCache(inner, capacity)
	localClock := storetest.NewClock()
	c.now = localClock.Now
	return c, inner, storeClock, localClock
}

// tenantRequest is memTestRequest for the tenant with credential cred.
func cacheTenantRequest(cred, key string) store.AcquireRequest {
	req := storetest.Request("cred", key, "body")
	req.Key.CredentialHash = sha256.Sum256([]byte(cred))
	return req
}

// testResponse is a replayable response whose body names what it answers.
func cacheResponse(body string) *store.Response {
	return &store.Response{
		Status:     http.StatusCreated,
		Header:     http.Header{"Content-Type": {"application/json"}, "X-Multi": {"one", "two"}},
		Body:       []byte(body),
		Replayable: true,
		BodySize:   int64(len(body)),
	}
}

// execute creates and completes the record of req through s.
func cacheExecute(t *testing.T, s store.Store, req store.AcquireRequest, resp *store.Response) {
	t.Helper()
	storetest.MustAcquire(t, s, req, store.OutcomeCreated)
	if err := s.Complete(context.Background(), req.Key, req.Token, resp, req.Retention); err != nil {
		t.Fatalf("Complete(%q): %v", req.Key.Key, err)
	}
}

func wantCacheReplay(t *testing.T, c *replayCache, inner *cacheCountingStore, req store.AcquireRequest, body string) {
	t.Helper()
	before := inner.acquires.Load()
	rec := storetest.MustAcquire(t, c, storetest.Retry(req), store.OutcomeExisting)
	if n := inner.acquires.Load() - before; n != 0 {
		t.Errorf("replay of %q reached the store %d times, want 0", req.Key.Key, n)
	}
	if rec.Status != store.StatusCompleted || rec.Response == nil || string(rec.Response.Body) != body {
		t.Fatalf("replay of %q = %+v, want the completed record with body %q", req.Key.Key, rec, body)
	}
	if rec.Fingerprint != req.Fingerprint || rec.Method != req.Method || rec.Path != req.Path {
		t.Errorf("cached record describes another request: %+v", rec)
	}
	// The handler replays no record without a lifetime left.
	if rec.TTL <= 0 || rec.TTL > req.Retention {
		t.Errorf("replay of %q has %v to live, want a part of the retention, %v", req.Key.Key, rec.TTL, req.Retention)
	}
}

func wantCacheMiss(t *testing.T, c *replayCache, inner *cacheCountingStore, req store.AcquireRequest, want store.Outcome) *store.Record {
	t.Helper()
	before := inner.acquires.Load()
	rec := storetest.MustAcquire(t, c, req, want)
	if n := inner.acquires.Load() - before; n != 1 {
		t.Errorf("Acquire(%q) reached the store %d times, want 1", req.Key.Key, n)
	}
	return rec
}

func TestReplayCacheLearnsFromComplete(t *testing.T) {
	c, inner, _, _ := newCacheTest(1 << 20)
	req := storetest.Request("cred", "key-complete", "body")
	cacheExecute(t, c, req, cacheResponse("first"))
	wantCacheReplay(t, c, inner, req, "first")
	wantCacheReplay(t, c, inner, req, "first")

	// The caller gave the response up (Store.Complete): the cache keeps
	// its body as it is, without a copy per first execution.
	resp := cacheResponse("second")
	req2 := storetest.Request("cred", "key-share", "body")
	cacheExecute(t, c, req2, resp)
	rec := storetest.MustAcquire(t, c, storetest.Retry(req2), store.OutcomeExisting)
	if string(rec.Response.Body) != "second" || rec.Response.Header.Get("Content-Type") != "application/json" {
		t.Errorf("cached response %q %v, want the one completed", rec.Response.Body, rec.Response.Header)
	}
	if &rec.Response.Body[0] != &resp.Body[0] {
		t.Error("the cache copied the body it was given")
	}
}

// In front of the memory store the cache learns from replays only: a
// first execution costs it nothing.
func TestReplayCacheWithoutLearnOnComplete(t *testing.T) {
	c, inner, _, _ := newCacheTest(1 << 20)
	c.learnOnComplete = false
	req := storetest.Request("cred", "key-learn-late", "body")
	cacheExecute(t, c, req, cacheResponse("first"))
	if len(c.pending) != 0 || len(c.entries) != 0 {
		t.Fatalf("a first execution left %d pending records and %d entries", len(c.pending), len(c.entries))
	}
	wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
	wantCacheReplay(t, c, inner, req, "first")
}

func TestReplayCacheLearnsFromAcquire(t *testing.T) {
	c, inner, _, _ := newCacheTest(1 << 20)
	req := storetest.Request("cred", "key-other-instance", "body")
	// Another instance (straight to the store) executed the request.
	cacheExecute(t, inner.Store, req, cacheResponse("elsewhere"))

	rec := wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
	if string(rec.Response.Body) != "elsewhere" {
		t.Fatalf("first replay = %q", rec.Response.Body)
	}
	wantCacheReplay(t, c, inner, req, "elsewhere")

	// A different request under the key is answered from the cache too,
	// with the record that tells the handler it is a mismatch.
	other := storetest.Retry(req)
	other.Fingerprint = [32]byte{9}
	got := storetest.MustAcquire(t, c, other, store.OutcomeExisting)
	if got.Fingerprint != req.Fingerprint {
		t.Errorf("mismatching request got fingerprint %x, want the original's", got.Fingerprint)
	}
}

func TestReplayCacheNeverCachesInProgress(t *testing.T) {
	c, inner, _, _ := newCacheTest(1 << 20)
	req := storetest.Request("cred", "key-in-progress", "body")
	storetest.MustAcquire(t, c, req, store.OutcomeCreated)

	// Retries while it runs all reach the store, and see it in progress.
	for range 3 {
		rec := wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
		if rec.Status != store.StatusInProgress {
			t.Fatalf("retry saw %s, want in_progress", rec.Status)
		}
	}
	// Completed by its owner: the next retry is a replay, not a stale
	// in-progress answer.
	if err := c.Complete(context.Background(), req.Key, req.Token, cacheResponse("done"), req.Retention); err != nil {
		t.Fatal(err)
	}
	wantCacheReplay(t, c, inner, req, "done")

	// In progress as seen through another instance: not cached either.
	req2 := storetest.Request("cred", "key-in-progress-elsewhere", "body")
	storetest.MustAcquire(t, inner.Store, req2, store.OutcomeCreated)
	for range 2 {
		wantCacheMiss(t, c, inner, storetest.Retry(req2), store.OutcomeExisting)
	}
	if n := len(c.entries); n != 1 {
		t.Errorf("cache holds %d entries, want 1 (the completed one)", n)
	}
}

func TestReplayCacheNeverServesExpired(t *testing.T) {
	t.Run("learned from Complete", func(t *testing.T) {
		c, inner, storeClock, localClock := newCacheTest(1 << 20)
		req := storetest.Request("cred", "key-expiring", "body")
		cacheExecute(t, c, req, cacheResponse("old"))
		localClock.Advance(storetest.Retention - time.Millisecond)
		storeClock.Advance(storetest.Retention - time.Millisecond)
		wantCacheReplay(t, c, inner, req, "old")

		localClock.Advance(time.Millisecond)
		storeClock.Advance(time.Millisecond)
		// Expired: the store treats it as absent and the request executes.
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeCreated)
	})

	t.Run("learned from Acquire, clocks skewed", func(t *testing.T) {
		c, inner, storeClock, localClock := newCacheTest(1 << 20)
		req := storetest.Request("cred", "key-skewed", "body")
		cacheExecute(t, inner.Store, req, cacheResponse("old"))
		// The store's clock runs 10s behind the cache's: its expiry is
		// 10s late on the cache's clock. The entry must not outlive the
		// record on the store's clock.
		localClock.Advance(10 * time.Second)
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
		wantCacheReplay(t, c, inner, req, "old")

		// Served until the record's expiry, as the store measures the
		// record's lifetime; from there on it is not.
		localClock.Advance(storetest.Retention - time.Millisecond)
		storeClock.Advance(storetest.Retention - time.Millisecond)
		wantCacheReplay(t, c, inner, req, "old")
		localClock.Advance(time.Millisecond)
		storeClock.Advance(time.Millisecond)
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeCreated)
	})

	t.Run("learned from Acquire, store clock ahead", func(t *testing.T) {
		c, inner, storeClock, localClock := newCacheTest(1 << 20)
		// The store's clock runs an hour ahead: taken at its word, the
		// record would live an hour too long on the cache's clock. The
		// retention bounds the entry from the moment it was learned.
		storeClock.Advance(time.Hour)
		req := storetest.Request("cred", "key-ahead", "body")
		cacheExecute(t, inner.Store, req, cacheResponse("old"))
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
		localClock.Advance(storetest.Retention - time.Millisecond)
		storeClock.Advance(storetest.Retention - time.Millisecond)
		wantCacheReplay(t, c, inner, req, "old")
		localClock.Advance(time.Millisecond)
		storeClock.Advance(time.Millisecond)
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeCreated)
	})

	t.Run("learned from Complete, store clock ahead", func(t *testing.T) {
		c, inner, storeClock, localClock := newCacheTest(1 << 20)
		// Whatever the store's clock, the record expires a retention
		// after it was created, which is after the Acquire began here.
		storeClock.Advance(time.Hour)
		req := storetest.Request("cred", "key-complete-ahead", "body")
		cacheExecute(t, c, req, cacheResponse("old"))
		localClock.Advance(storetest.Retention - time.Millisecond)
		storeClock.Advance(storetest.Retention - time.Millisecond)
		wantCacheReplay(t, c, inner, req, "old")
		localClock.Advance(time.Millisecond)
		storeClock.Advance(time.Millisecond)
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeCreated)
	})
}

func TestReplayCacheTenantsAreIsolated(t *testing.T) {
	c, inner, _, _ := newCacheTest(1 << 20)
	a := cacheTenantRequest("Bearer tenant-a", "shared-key")
	cacheExecute(t, c, a, cacheResponse("tenant a's"))
	wantCacheReplay(t, c, inner, a, "tenant a's")

	// Tenant B, same key and same request: its own execution.
	b := cacheTenantRequest("Bearer tenant-b", "shared-key")
	wantCacheMiss(t, c, inner, b, store.OutcomeCreated)
	if err := c.Complete(context.Background(), b.Key, b.Token, cacheResponse("tenant b's"), b.Retention); err != nil {
		t.Fatal(err)
	}
	wantCacheReplay(t, c, inner, b, "tenant b's")
	wantCacheReplay(t, c, inner, a, "tenant a's")
}

func TestReplayCacheKeepsOnlyWhatItMay(t *testing.T) {
	t.Run("not replayable", func(t *testing.T) {
		c, inner, _, _ := newCacheTest(1 << 20)
		req := storetest.Request("cred", "key-too-large", "body")
		cacheExecute(t, c, req, &store.Response{Status: 200, Header: http.Header{}, Replayable: false, BodySize: 1 << 30})
		rec := wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
		if rec.Response.Replayable {
			t.Fatal("store says replayable")
		}
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
	})
	t.Run("larger than a share of the cache", func(t *testing.T) {
		c, inner, _, _ := newCacheTest(64 << 10)
		req := storetest.Request("cred", "key-big", "body")
		cacheExecute(t, c, req, cacheResponse(strings.Repeat("x", 8<<10)))
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
	})
	t.Run("released", func(t *testing.T) {
		c, inner, _, _ := newCacheTest(1 << 20)
		req := storetest.Request("cred", "key-released", "body")
		storetest.MustAcquire(t, c, req, store.OutcomeCreated)
		if err := c.Release(context.Background(), req.Key, req.Token); err != nil {
			t.Fatal(err)
		}
		if len(c.pending) != 0 {
			t.Errorf("%d pending records after release", len(c.pending))
		}
		wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeCreated)
	})
	t.Run("lock lost", func(t *testing.T) {
		c, inner, storeClock, _ := newCacheTest(1 << 20)
		req := storetest.Request("cred", "key-lost", "body")
		storetest.MustAcquire(t, c, req, store.OutcomeCreated)
		// A retry takes the stale lock over, through another instance,
		// and completes it with its own response.
		storeClock.Advance(storetest.LockTimeout + time.Second)
		other := storetest.Retry(req)
		storetest.MustAcquire(t, inner.Store, other, store.OutcomeTakenOver)
		if err := inner.Store.Complete(context.Background(), other.Key, other.Token, cacheResponse("taker's"), other.Retention); err != nil {
			t.Fatal(err)
		}
		err := c.Complete(context.Background(), req.Key, req.Token, cacheResponse("loser's"), req.Retention)
		if !errors.Is(err, store.ErrLockLost) {
			t.Fatalf("Complete = %v, want ErrLockLost", err)
		}
		if len(c.pending) != 0 || len(c.entries) != 0 {
			t.Errorf("after a lost lock: %d pending, %d entries", len(c.pending), len(c.entries))
		}
		rec := wantCacheMiss(t, c, inner, storetest.Retry(req), store.OutcomeExisting)
		if string(rec.Response.Body) != "taker's" {
			t.Errorf("replay = %q, want the taker's", rec.Response.Body)
		}
	})
}

func TestReplayCacheEvictsLeastRecentlyUsed(t *testing.T) {
	body := strings.Repeat("b", 600)
	// Room for three entries of about 1 KiB, and entries up to 1 KiB.
	entry := cacheEntryOverhead + int64(len("key-lru-0")+len(http.MethodPost)+len("/v1/charges")+len(body)) +
		int64(len("Content-Type")+len("application/json")+16+len("X-Multi")+len("one")+len("two")+32)
	c, inner, _, _ := newCacheTest(3*entry + entry/2)
	c.maxEntry = entry
	reqs := make([]store.AcquireRequest, 4)
	for i := range reqs {
		reqs[i] = storetest.Request("cred", fmt.Sprintf("key-lru-%d", i), "body")
	}
	for _, r := range reqs[:3] {
		cacheExecute(t, c, r, cacheResponse(body))
	}
	wantCacheReplay(t, c, inner, reqs[0], body)      // 0 is now the most recent
	cacheExecute(t, c, reqs[3], cacheResponse(body)) // evicts 1, the least recent
	wantCacheReplay(t, c, inner, reqs[0], body)
	wantCacheReplay(t, c, inner, reqs[2], body)
	wantCacheReplay(t, c, inner, reqs[3], body)
	wantCacheMiss(t, c, inner, storetest.Retry(reqs[1]), store.OutcomeExisting)
	if c.size > c.capacity {
		t.Errorf("size %d over capacity %d", c.size, c.capacity)
	}
}

func TestReplayCacheBoundedByBytes(t *testing.T) {
	c, _, _, _ := newCacheTest(64 << 10)
	for i := range 500 {
		cacheExecute(t, c, storetest.Request("cred", fmt.Sprintf("key-bound-%04d", i), "body"), cacheResponse(strings.Repeat("z", 1000)))
		if c.size > c.capacity {
			t.Fatalf("after %d entries: size %d over capacity %d", i+1, c.size, c.capacity)
		}
	}
	var sum int64
	n := 0
	for e := c.lru.next; e != &c.lru; e = e.next {
		sum += e.size
		n++
	}
	if sum != c.size || n != len(c.entries) {
		t.Errorf("list holds %d entries of %d bytes; map %d, size %d", n, sum, len(c.entries), c.size)
	}
	if n < 30 {
		t.Errorf("only %d entries of ~1.4 KiB fit in 64 KiB", n)
	}
}

func TestReplayCacheSweepsAbandonedPending(t *testing.T) {
	c, _, _, localClock := newCacheTest(1 << 20)
	storetest.MustAcquire(t, c, storetest.Request("cred", "key-abandoned", "body"), store.OutcomeCreated)
	localClock.Advance(storetest.Retention + time.Minute)
	storetest.MustAcquire(t, c, storetest.Request("cred", "key-later", "body"), store.OutcomeCreated)
	if len(c.pending) != 1 {
		t.Errorf("%d pending records, want 1: the abandoned one is past its expiry", len(c.pending))
	}
}

// TestReplayCacheConcurrent runs executions and replays of overlapping
// keys of several tenants through one small cache (under -race in CI):
// every answer must be the response of its own tenant and key.
func TestReplayCacheConcurrent(t *testing.T) {
	mem := memory.New(100_000, time.Now)
	c := newReplayCache(mem, 32<<10)
	tenants := []string{"Bearer t1", "Bearer t2", "Bearer t3"}
	const keys, workers, ops = 40, 8, 400
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for range ops {
				tenant := tenants[rng.IntN(len(tenants))]
				key := fmt.Sprintf("key-conc-%03d", rng.IntN(keys))
				want := tenant + "/" + key
				req := cacheTenantRequest(tenant, key)
				res, err := c.Acquire(context.Background(), req)
				if err != nil {
					t.Error(err)
					return
				}
				switch res.Outcome {
				case store.OutcomeCreated:
					if rng.IntN(5) == 0 {
						if err := c.Release(context.Background(), req.Key, req.Token); err != nil {
							t.Error(err)
						}
						continue
					}
					if err := c.Complete(context.Background(), req.Key, req.Token, cacheResponse(want), req.Retention); err != nil {
						t.Error(err)
					}
				case store.OutcomeExisting:
					rec := res.Record
					if rec.Status == store.StatusCompleted && string(rec.Response.Body) != want {
						t.Errorf("%s got %q", want, rec.Response.Body)
						return
					}
				default:
					t.Errorf("outcome %v", res.Outcome)
				}
			}
		})
	}
	wg.Wait()
	if c.size > c.capacity {
		t.Errorf("size %d over capacity %d", c.size, c.capacity)
	}
	if len(c.pending) != 0 {
		t.Errorf("%d pending records left", len(c.pending))
	}
}

func TestReplayCacheProvision(t *testing.T) {
	size := func(n int64) *int64 { return &n }
	for _, tc := range []struct {
		name      string
		cache     *int64
		backend   string
		wantCache int64 // 0: no cache
	}{
		{"default", nil, "cache_test", defaultReplayCache},
		{"sized", size(1 << 10), "cache_test", 1 << 10},
		{"off", size(0), "cache_test", 0},
		{"memory store too", nil, "memory", defaultReplayCache},
		{"memory store, off", size(0), "memory", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := &Handler{ReplayCache: tc.cache, PruneInterval: new(caddy.Duration)}
			h.StoreRaw = []byte(`{"backend":"` + tc.backend + `"}`)
			if err := provisionHandler(t, h); err != nil {
				t.Fatal(err)
			}
			if err := h.Validate(); err != nil {
				t.Fatal(err)
			}
			// Found through the wrappers, the cache or none: the memory
			// store's calls go without a timer.
			if h.inProcess != (tc.backend == "memory") {
				t.Errorf("inProcess = %v with the %s store", h.inProcess, tc.backend)
			}
			rc, ok := h.store.(*replayCache)
			if tc.wantCache == 0 {
				if ok {
					t.Fatalf("store is cached (%d bytes), want none", rc.capacity)
				}
				return
			}
			if !ok || rc.capacity != tc.wantCache {
				t.Fatalf("store %T, want a cache of %d bytes", h.store, tc.wantCache)
			}
			if rc.learnOnComplete != (tc.backend != "memory") {
				t.Errorf("learnOnComplete = %v with the %s store", rc.learnOnComplete, tc.backend)
			}
		})
	}
	neg := int64(-1)
	h := &Handler{ReplayCache: &neg, PruneInterval: new(caddy.Duration)}
	h.StoreRaw = []byte(`{"backend":"cache_test"}`)
	if err := provisionHandler(t, h); err != nil {
		t.Fatal(err)
	}
	if err := h.Validate(); err == nil {
		t.Error("replay_cache -1 validated")
	}
}

func TestReplayCacheCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		err  bool
	}{
		{"replay_cache 8MiB", 8 << 20, false},
		{"replay_cache 100kb", 100_000, false},
		{"replay_cache 0", 0, false},
		{"replay_cache off", 0, false},
		{"replay_cache", 0, true},
		{"replay_cache lots", 0, true},
		{"replay_cache 1MiB 2MiB", 0, true},
	} {
		h := new(Handler)
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("idempotency {\n" + tc.in + "\n}"))
		if tc.err {
			if err == nil {
				t.Errorf("%q: no error", tc.in)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		if h.ReplayCache == nil || *h.ReplayCache != tc.want {
			t.Errorf("%q: replay_cache = %v, want %d", tc.in, h.ReplayCache, tc.want)
		}
	}
}

// cacheTestStore is a store module of its own, for the provisioning test.
type cacheTestStore struct{ store.Store }

func (cacheTestStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID: "http.handlers.idempotency.stores.cache_test",
		New: func() caddy.Module {
			return &cacheTestStore{Store: memory.New(10, time.Now)}
		},
	}
}

func init() { caddy.RegisterModule(cacheTestStore{}) }

// A body the replay cache keeps holds at most an eighth (or 256 bytes)
// more than its bytes, as the stores' (store.KeptBody); a tight one is
// kept as it is, without a copy.
func TestCachedBodiesAreCutToTheirSize(t *testing.T) {
	loose := make([]byte, 10, 64<<10)
	tight := make([]byte, 100, 110)
	if got := cachedResponse(&store.Response{Body: loose}).Body; len(got) != 10 || cap(got) > 10+256 {
		t.Errorf("the replay cache keeps a body of %d bytes in a buffer of %d", len(got), cap(got))
	}
	if got := cachedResponse(&store.Response{Body: tight}).Body; &got[0] != &tight[0] {
		t.Error("the replay cache copied a body that fits its buffer")
	}
}
