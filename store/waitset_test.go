package store

import (
	"context"
	"testing"
	"time"
)

// A waiter is woken by its own key's wake and by WakeAll, and forgotten
// once its context ends: keys whose records never complete (expired,
// pruned) must not pile up. Catches a set that keeps cancelled waiters,
// and one whose wake reaches another key's.
func TestWaitSetWakesAndForgets(t *testing.T) {
	var s WaitSet[string]
	ctx, cancel := context.WithCancel(context.Background())
	a, b := s.Wait(ctx, "a"), s.Wait(ctx, "b")
	s.Wake("a")
	select {
	case <-a:
	default:
		t.Fatal("the waiter of a was not woken")
	}
	select {
	case <-b:
		t.Fatal("waking a woke b")
	default:
	}
	s.WakeAll()
	<-b
	c := s.Wait(ctx, "c")
	cancel()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s.mu.Lock()
		n := len(s.m)
		s.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d keys still waited on after their contexts ended", n)
		}
		time.Sleep(time.Millisecond)
	}
	select {
	case <-c:
		t.Fatal("a forgotten waiter was woken")
	default:
	}
}

// WakeWhere wakes the waiters of the keys it is told, and leaves the rest
// waiting.
func TestWaitSetWakesWhere(t *testing.T) {
	var s WaitSet[string]
	ctx := context.Background()
	a, b := s.Wait(ctx, "a"), s.Wait(ctx, "b")
	s.WakeWhere(func(k string) bool { return k == "a" })
	select {
	case <-a:
	default:
		t.Fatal("the waiter of a was not woken")
	}
	select {
	case <-b:
		t.Fatal("waking where a woke b")
	default:
	}
	s.Wake("b")
	<-b
}
