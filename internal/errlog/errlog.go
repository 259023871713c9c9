// Package errlog bounds the idempotency.store_error lines, of the
// handler and of a store alike: at most one a second per operation, each
// saying how many it stands for, so that an outage's thousands of
// failures write a few lines rather than flood the log.
package errlog

import (
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Interval is the least time between two idempotency.store_error lines
// of one operation.
const Interval = time.Second

// processStart is what the limiters' times count from: the monotonic
// clock, which a change of the wall clock does not move.
var processStart = time.Now()

// Now is the time a Limiter counts in.
func Now() time.Duration { return time.Since(processStart) }

// Limiter lets a line through once per Interval at most,
// and counts the lines it leaves out. It costs a failure a load and an
// add, and one failure an interval a compare-and-swap: the failures of an
// outage never queue on a lock.
type Limiter struct {
	// next is when the next line may be written, as Now tells
	// time; suppressed counts the lines left out since the last one.
	next, suppressed atomic.Int64
}

// Allow reports whether a line may be written at now, and if so how many
// were left out before it.
func (l *Limiter) Allow(now time.Duration) (ok bool, suppressed int64) {
	next := l.next.Load()
	if int64(now) >= next && l.next.CompareAndSwap(next, int64(now+Interval)) {
		return true, l.suppressed.Swap(0)
	}
	l.suppressed.Add(1)
	return false, 0
}

// TakeSuppressed returns the number of lines left out since the last
// one, and counts them as told: they are reported elsewhere (an
// outage's end).
func (l *Limiter) TakeSuppressed() int64 { return l.suppressed.Swap(0) }

// Fields are the fields of a store_error line of op: the
// operation, then fields (the request's), the error, and the number of
// lines left out before this one, if any.
func Fields(op string, err error, suppressed int64, fields ...zap.Field) []zap.Field {
	f := make([]zap.Field, 0, len(fields)+3)
	f = append(append(append(f, zap.String("operation", op)), fields...), zap.Error(err))
	if suppressed > 0 {
		f = append(f, zap.Int64("suppressed", suppressed))
	}
	return f
}
