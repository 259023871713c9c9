package idempotency

// How a handler logs its store's failures. During an outage every
// request fails alike, and a line for each (thousands in 20 seconds)
// buries the lines that say something else; meanwhile the requests that
// the outage only held up, their completions retried until the store
// answered, said nothing at all. So each operation writes about one
// idempotency.store_error line a second while it fails, counting the
// lines it left out, and two lines frame an outage: one when the store
// stops answering, one when it answers again.

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/errlog"
	"github.com/caddy-idempotency/idempotency/store"
	"go.uber.org/zap"
)

// opCredentialSecret names the failure to read the store's credential
// secret, in the store_error lines.
const opCredentialSecret = "credential_secret"

// loggedOps are the operations whose store_error lines a handler limits,
// each on its own.
var loggedOps = [...]string{store.OpAcquire, store.OpComplete, store.OpRelease, store.OpRenew, store.OpPrune, opCredentialSecret}

// storeLog is a handler's account of its store's failures: the limiters
// of its store_error lines, and the outage under way, if any. Per
// handler, as the lines are: each names its handler's server, and a
// handler whose store is down logs it even while another handler of the
// same database has just done so.
type storeLog struct {
	h   *Handler
	now func() time.Duration // errlog.Now; a test's clock

	ops [len(loggedOps)]errlog.Limiter

	// classifier reads the store's own errors, if it can (unanswered).
	classifier store.Classifier

	// epoch is even while the store answers, odd while it does not: the
	// start and the end of each outage add one. A call notes the epoch
	// as it starts (begin): only a call sent during an outage ends it by
	// an answer, and only a call sent since the last one ended starts
	// another by its failure. The calls in flight across the edge of an
	// outage (an answer to a statement sent before it, a timeout of one
	// sent during it) would make an edge of their own otherwise.
	epoch atomic.Int64
	// held counts the requests held during the outage, their completion
	// retried until the store answers; failed, the calls that failed.
	held, failed atomic.Int64

	mu    sync.Mutex // orders the two lines of an outage
	since time.Duration
}

func newStoreLog(h *Handler) *storeLog { return &storeLog{h: h, now: errlog.Now} }

// allow reports whether a store_error line of op may be written now, and
// how many were left out before it. Every line of an unknown operation
// is written.
func (l *storeLog) allow(op string) (ok bool, suppressed int64) {
	if l == nil {
		return true, 0
	}
	for i := range loggedOps {
		if loggedOps[i] == op {
			return l.ops[i].Allow(l.now())
		}
	}
	return true, 0
}

// begin returns what a store call notes as it starts (observed).
func (l *storeLog) begin() int64 {
	if l == nil {
		return 0
	}
	return l.epoch.Load()
}

// observed takes in the outcome of the store call op, which began at
// epoch: a store that does not answer begins an outage, one that answers
// ends it. A call that its caller gave up tells neither.
//
// A cancelled statement is never an answer. A batch's statement runs
// under a context of its own, cancelled once every request in it has
// given up (sendBatch), and pgx then returns context.Canceled, not the
// callers' deadline: the caller whose deadline passed got no answer in
// time, and one whose context is still live (the store closing) learnt
// nothing.
func (l *storeLog) observed(ctx context.Context, op string, epoch int64, err error) {
	if l == nil {
		return
	}
	switch {
	case err != nil && errors.Is(ctx.Err(), context.Canceled):
	case errors.Is(err, context.Canceled) && ctx.Err() == nil:
	case err == nil || !l.noAnswer(err):
		if epoch&1 == 1 && l.epoch.CompareAndSwap(epoch, epoch+1) {
			l.answered()
		}
	case epoch&1 == 0 && l.epoch.CompareAndSwap(epoch, epoch+1):
		l.failed.Add(1)
		l.unavailable(op, err)
	case l.epoch.Load()&1 == 1:
		l.failed.Add(1)
	}
}

// unavailable begins an outage, whose first failure was op's err. The
// limiters go on as they were: an outage that begins within a second of
// an operation's last line (the store flapping) must not let a second
// line through. The lines left out since each operation's last one and
// not yet counted (the failures of calls that outlived the last outage)
// are counted here, so that the next outage's lines count its own.
func (l *storeLog) unavailable(op string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.since = l.now()
	fields := []zap.Field{zap.String("operation", op), zap.Error(err)}
	if suppressed := l.takeSuppressed(); len(suppressed) > 0 {
		fields = append(fields, zap.Any("suppressed_store_errors", suppressed))
	}
	l.h.logger.Warn("idempotency.store_unavailable", fields...)
}

// takeSuppressed returns, by operation, the store_error lines left out
// and not yet counted, and counts them as told.
func (l *storeLog) takeSuppressed() map[string]int64 {
	var suppressed map[string]int64
	for i := range l.ops {
		if n := l.ops[i].TakeSuppressed(); n > 0 {
			if suppressed == nil {
				suppressed = make(map[string]int64)
			}
			suppressed[loggedOps[i]] = n
		}
	}
	return suppressed
}

// answered ends the outage, saying how long it lasted, what it held up
// and what it failed, and the store_error lines left out since each
// operation's last one.
func (l *storeLog) answered() {
	l.mu.Lock()
	defer l.mu.Unlock()
	fields := []zap.Field{
		zap.Float64("down_seconds", (l.now() - l.since).Seconds()),
		zap.Int64("held", l.held.Swap(0)),
		zap.Int64("failed", l.failed.Swap(0)),
	}
	if suppressed := l.takeSuppressed(); len(suppressed) > 0 {
		fields = append(fields, zap.Any("suppressed_store_errors", suppressed))
	}
	l.h.logger.Info("idempotency.store_recovered", fields...)
}

// holding counts a request whose completion the outage holds up, once.
func (l *storeLog) holding() {
	if l != nil && l.epoch.Load()&1 == 1 {
		l.held.Add(1)
	}
}

// unanswered reports whether err says that the store did not answer: a
// connection refused, lost or timed out, or what the store reads as such
// in its backend's errors (store.Classifier: a server shutting down or
// starting up, a standby's read-only answer during a failover). The
// store answering with an error of its own (a lost lock, a refused
// value, a statement it rejects) is an answer.
func (l *storeLog) unanswered(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	if l != nil && l.classifier != nil && l.classifier.Unanswered(err) {
		return true
	}
	var netErr net.Error
	return errors.As(err, &netErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// noAnswer reports whether err, the failure of a store call whose caller
// had not given up, says that the store did not answer (observed): a
// statement cancelled on the caller's behalf is one that its deadline
// cut short.
func (l *storeLog) noAnswer(err error) bool {
	return l.unanswered(err) || errors.Is(err, context.Canceled)
}
