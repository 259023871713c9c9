package postgres

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
)

// Group commit. Postgres spends most of a statement's cost on the
// statement itself (a wake-up, a parse/bind/execute, a commit, a write
// each side), little on its row. So the requests that need the same kind
// of statement at the same time share one: a batcher sends whatever is
// queued as one statement over arrays, and while it is in flight the
// next batch gathers. Nothing waits for a batch to fill: an idle store
// sends batches of one at once, as it sent single statements before.

// batchRows and batchBytes bound a batch: a batch of many rows holds its
// row locks, and the requests behind it, for longer, and a batch of
// large responses is a large message.
const (
	batchRows  = 64
	batchBytes = 1 << 20
)

// batchLanes is how many statements of one kind a store has in flight at
// once, at most. One carries the load: while its batch is in flight, the
// next one gathers, and a store that sent two at a time sent batches of
// half the size, each costing Caddy a round trip (a write and a wake-up
// each side: on two CPUs, 12 µs of Caddy's CPU more per first execution,
// BenchmarkFirstExecutionPostgres). The second opens only when the kind
// has made no progress for batchStall (a statement waiting for a row
// lock, a commit waiting for a slow disk), so that such a statement never
// stops its kind altogether.
const batchLanes = 2

// batchStall is how long a kind of statement goes without finishing a
// batch, while requests queue, before a second lane opens: some ten
// times a batch's commit on a local disk.
const batchStall = 10 * time.Millisecond

// batchCall is one request's part of a batch: the batch's sender sets
// res and err, then closes done.
type batchCall[Req, Res any] struct {
	ctx  context.Context
	req  Req
	res  Res
	err  error
	done chan struct{}
	// followers are the calls for the same key that wait for this
	// one's outcome (batcher.follow).
	followers []*batchCall[Req, Res]
}

// batcher sends the calls queued for one kind of statement, in batches,
// over at most lanes statements at a time.
type batcher[Req, Res any] struct {
	lanes int
	// key is the row a request works on: two calls for one row never
	// share a statement (an INSERT ... ON CONFLICT DO UPDATE cannot
	// affect a row twice), so the later follows the earlier (follow)
	// or waits for the next batch.
	key func(Req) store.RecordKey
	// size is what a request adds to the statement, in bytes.
	size func(Req) int
	// send runs one statement for calls, sorted by key, and sets each
	// call's outcome.
	send func(ctx context.Context, calls []*batchCall[Req, Res])
	// follow, if set, lets a call for a key that the batch already has
	// ride on that key's call, the lead, rather than wait for a batch
	// of its own: many requests for one key (a client retrying in a
	// loop, a replay storm) would otherwise go one statement each, one
	// after the other, holding up every other key's requests behind
	// them. Once the lead's statement has run, follow sets c's outcome
	// from the lead's, or reports false when the lead's outcome need
	// not be c's; c then goes in the next batch.
	follow func(lead, c *batchCall[Req, Res]) bool
	// stallAfter, if set, keeps all lanes but one shut until no batch has
	// finished for that long while calls queue (batchLanes); then one
	// more batch goes at a time, on another lane. Without it, every lane
	// opens as calls arrive.
	stallAfter time.Duration

	mu      sync.Mutex
	queue   []*batchCall[Req, Res]
	sending int
	// progress is when a lane last opened or finished a batch; watch,
	// while watching, fires stallAfter after it (unstall).
	progress time.Time
	watch    *time.Timer
	watching bool
}

// do queues req and returns its outcome once its batch has run, or ctx's
// error once ctx is done.
func (b *batcher[Req, Res]) do(ctx context.Context, req Req) (Res, error) {
	c := &batchCall[Req, Res]{ctx: ctx, req: req, done: make(chan struct{})}
	b.mu.Lock()
	b.queue = append(b.queue, c)
	var batch []*batchCall[Req, Res]
	open := b.lanes
	if b.stallAfter > 0 {
		open = 1
	}
	if b.sending < open {
		if batch = b.take(); len(batch) > 0 {
			b.sending++
			b.watchStalls()
		}
	}
	b.mu.Unlock()
	if len(batch) > 0 {
		// The caller sends the batch it started itself, which spares an
		// idle store a goroutine's start per request; what queued
		// meanwhile goes on in a goroutine of its own.
		b.sendBatch(batch)
		if next := b.next(); len(next) > 0 {
			go b.run(next)
		}
	}
	select {
	case <-c.done:
		return c.res, c.err
	case <-ctx.Done():
		var zero Res
		return zero, ctx.Err()
	}
}

// run sends batch, then whatever queued meanwhile, until the queue is
// empty.
func (b *batcher[Req, Res]) run(batch []*batchCall[Req, Res]) {
	for len(batch) > 0 {
		b.sendBatch(batch)
		batch = b.next()
	}
}

// next takes the batch that follows one just sent, or gives up the
// sender's lane when nothing is queued, or when another lane that
// unstall opened is still in flight: that one carries on.
func (b *batcher[Req, Res]) next() []*batchCall[Req, Res] {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stallAfter > 0 {
		b.progress = time.Now()
		if b.sending > 1 {
			b.sending--
			return nil
		}
	}
	batch := b.take()
	if len(batch) == 0 {
		b.sending--
	}
	return batch
}

// watchStalls notes a lane's opening, and has unstall look at the lanes
// from then on, if it does not already. The caller holds mu.
func (b *batcher[Req, Res]) watchStalls() {
	if b.stallAfter == 0 {
		return
	}
	b.progress = time.Now()
	if b.watching {
		return
	}
	b.watching = true
	if b.watch == nil {
		b.watch = time.AfterFunc(b.stallAfter, b.unstall)
	} else {
		b.watch.Reset(b.stallAfter)
	}
}

// unstall opens another lane when no batch has finished for stallAfter
// while calls queue, and looks again stallAfter later for as long as a
// lane is open. Of two lanes, the first to finish its batch closes
// (next).
func (b *batcher[Req, Res]) unstall() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.sending == 0 {
		b.watching = false
		return
	}
	wait := b.stallAfter - time.Since(b.progress)
	if wait <= 0 && b.sending < b.lanes {
		if batch := b.take(); len(batch) > 0 {
			b.sending++
			b.progress = time.Now()
			go b.run(batch)
		}
	}
	if wait <= 0 {
		wait = b.stallAfter
	}
	b.watch.Reset(wait)
}

// take removes the next batch from the queue, in arrival order, within
// the bounds, one call per key, with the calls that follow them. Calls
// whose requests have given up are dropped. The caller holds mu.
func (b *batcher[Req, Res]) take() []*batchCall[Req, Res] {
	var (
		batch []*batchCall[Req, Res]
		rest  = b.queue[:0]
		leads = make(map[store.RecordKey]*batchCall[Req, Res], min(len(b.queue), batchRows))
		size  int
	)
	for _, c := range b.queue {
		if c.ctx.Err() != nil {
			c.err = c.ctx.Err()
			close(c.done)
			continue
		}
		k := b.key(c.req)
		lead, dup := leads[k]
		if dup && b.follow != nil {
			lead.followers = append(lead.followers, c)
			continue
		}
		n := 0
		if b.size != nil {
			n = b.size(c.req)
		}
		if dup || len(batch) == batchRows || (len(batch) > 0 && size+n > batchBytes) {
			rest = append(rest, c)
			continue
		}
		leads[k] = c
		size += n
		batch = append(batch, c)
	}
	clear(b.queue[len(rest):])
	b.queue = rest
	return batch
}

// sendBatch runs one statement for batch, until the last of its
// requests' deadlines (a request without one gives it store.CallTimeout,
// which bounds a round trip): one request's deadline must not fail the
// others. A request that gives up sooner returns at once (do) and leaves
// the statement to the others, or to run out: watching each request's
// context for the moment they have all given up cost an allocation and
// a lock per request, in a path where every request has a deadline.
func (b *batcher[Req, Res]) sendBatch(batch []*batchCall[Req, Res]) {
	var deadline time.Time
	for _, c := range batch {
		d, ok := c.ctx.Deadline()
		if !ok {
			d = time.Now().Add(store.CallTimeout)
		}
		if d.After(deadline) {
			deadline = d
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	// One order for the rows of every statement, on every instance: two
	// statements that lock rows in the same order never deadlock.
	slices.SortFunc(batch, func(x, y *batchCall[Req, Res]) int {
		return compareKeys(b.key(x.req), b.key(y.req))
	})
	b.send(ctx, batch)
	var again []*batchCall[Req, Res]
	for _, c := range batch {
		for _, f := range c.followers {
			if b.follow(c, f) {
				close(f.done)
			} else {
				again = append(again, f)
			}
		}
		c.followers = nil
		close(c.done)
	}
	cancel()
	if len(again) > 0 {
		// First in the queue, for the sender's next batch: they have
		// waited one batch already.
		b.mu.Lock()
		b.queue = append(again, b.queue...)
		b.mu.Unlock()
	}
}

// compareKeys orders record keys as every batch takes its rows.
func compareKeys(x, y store.RecordKey) int {
	if c := bytes.Compare(x.CredentialHash[:], y.CredentialHash[:]); c != 0 {
		return c
	}
	return strings.Compare(x.Key, y.Key)
}

// inputRows is the query that gives a statement its requests, a row each,
// with the columns cols, each "type name", and n, the row's ordinal. The
// statement's first parameters are the columns, in their order: for a
// batch, arrays of one element per request, which fn, a function of
// migration 0006, turns into rows; in the form for one request, the
// values themselves. A batch of one sent in the batch's form costs
// Postgres about a tenth more than in its own (the arrays, the function),
// which a request at low load would wait for.
func inputRows(fn string, one bool, cols ...string) string {
	params, values := make([]string, len(cols)), make([]string, len(cols))
	for i, col := range cols {
		typ, name, _ := strings.Cut(col, " ")
		params[i] = fmt.Sprintf("$%d::%s[]", i+1, typ)
		values[i] = fmt.Sprintf("$%d::%s AS %s", i+1, typ, name)
	}
	if one {
		return "SELECT " + strings.Join(values, ", ") + ", 1::bigint AS n"
	}
	return fmt.Sprintf("SELECT * FROM %s(%s) AS i", fn, strings.Join(params, ", "))
}

// statement is a statement of the store on the rows of a batch of
// requests, in its two forms: for a batch, and for one request.
type statement struct {
	batch, one string
	// columns is how many of its first parameters are the rows'.
	columns int
}

// newStatement builds a statement's two forms with build, from the query
// that gives its rows, with the columns cols, which the function fn gives
// a batch (see inputRows).
func newStatement(fn string, cols []string, build func(rows string) string) statement {
	return statement{batch: build(inputRows(fn, false, cols...)), one: build(inputRows(fn, true, cols...)), columns: len(cols)}
}

// forRows is the statement's text and arguments for rows requests, whose
// first arguments are the rows' columns, each an array of an element per
// request (a slice): a single request is sent in the form for one, with
// the elements themselves.
func (st statement) forRows(rows int, args []any) (string, []any) {
	if rows != 1 {
		return st.batch, args
	}
	one := slices.Clone(args)
	for i := range st.columns {
		one[i] = args[i].(interface{ first() any }).first()
	}
	return st.one, one
}

// followAcquire gives c, an acquire of the key that lead acquired in the
// batch before it, lead's outcome where the statement would have given
// it the same: a completed record, live (the statement never answers an
// expired one), whatever c's request; a record in progress, to a request of
// the same fingerprint, which takes a stale lock over exactly when lead
// would have. Not to an acquire whose earlier attempt may have created
// the record in progress: that record is its own. Anything else, a
// failed statement included, c sends itself.
func followAcquire(lead, c *batchCall[queuedAcquire, store.AcquireResult]) bool {
	if lead.err != nil || c.req.mayHaveCommitted || lead.res.Outcome != store.OutcomeExisting || lead.res.Record == nil {
		return false
	}
	if lead.res.Record.Status != store.StatusCompleted && lead.req.Fingerprint != c.req.Fingerprint {
		return false
	}
	rec := *lead.res.Record
	c.res = store.AcquireResult{Outcome: store.OutcomeExisting, Record: &rec}
	return true
}
