package errlog

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A line per second at most, however the failures race, and the lines
// left out are all counted: by the next line, or still pending.
func TestLineLimiterCountsEveryFailure(t *testing.T) {
	var l Limiter
	var written, reported atomic.Int64
	var wg sync.WaitGroup
	now := time.Hour
	for round := range 3 {
		for range 8 {
			wg.Go(func() {
				for range 500 {
					if ok, n := l.Allow(now + time.Duration(round)*Interval); ok {
						written.Add(1)
						reported.Add(n)
					}
				}
			})
		}
		wg.Wait()
	}
	if written.Load() != 3 {
		t.Errorf("%d lines written over 3 intervals, want 3", written.Load())
	}
	if got := written.Load() + reported.Load() + l.suppressed.Load(); got != 3*8*500 {
		t.Errorf("written, reported left out and pending add up to %d, want %d", got, 3*8*500)
	}
}
