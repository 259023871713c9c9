package store

import (
	"context"
	"sync"
)

// WaitSet is an in-process registry of waiters, keyed by record, for a
// store that implements Waiter: all waiters of one record share one
// channel, closed to wake them. The zero value is ready to use.
type WaitSet[K comparable] struct {
	mu sync.Mutex
	m  map[K]*waitEntry
}

type waitEntry struct {
	ch      chan struct{}
	waiters int
}

// Wait returns the channel that Wake(key) closes. The registration is
// dropped when ctx is done, so that keys whose records never complete
// (expired, pruned) do not accumulate.
func (s *WaitSet[K]) Wait(ctx context.Context, key K) <-chan struct{} {
	s.mu.Lock()
	if s.m == nil {
		s.m = make(map[K]*waitEntry)
	}
	e := s.m[key]
	if e == nil {
		e = &waitEntry{ch: make(chan struct{})}
		s.m[key] = e
	}
	e.waiters++
	s.mu.Unlock()
	context.AfterFunc(ctx, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		// After a wake the key may hold a newer entry: leave it alone.
		if s.m[key] == e {
			if e.waiters--; e.waiters == 0 {
				delete(s.m, key)
			}
		}
	})
	return e.ch
}

// Wake wakes the waiters of key, if any.
func (s *WaitSet[K]) Wake(key K) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.m[key]; ok {
		close(e.ch)
		delete(s.m, key)
	}
}

// WakeAll wakes every waiter, so that each looks at its record again.
func (s *WaitSet[K]) WakeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for key, e := range s.m {
		close(e.ch)
		delete(s.m, key)
	}
}

// WakeWhere wakes the waiters of the keys for which wake is true.
func (s *WaitSet[K]) WakeWhere(wake func(K) bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for key, e := range s.m {
		if wake(key) {
			close(e.ch)
			delete(s.m, key)
		}
	}
}
