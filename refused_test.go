package idempotency

import (
	"fmt"
	"net/http"
	"testing"
)

// An upstream's refusal before it ran anything (401, 403, 429) is not
// recorded: the client gets it as it came, and the retry, once the
// client waited or fixed its credential, executes and is then replayed.
// Catches a refusal stored and replayed to every retry.
func TestRefusalsAreNotRecorded(t *testing.T) {
	eachStore(t, func(t *testing.T, sb storeBackend) {
		for _, status := range []int{http.StatusUnauthorized, http.StatusForbidden, http.StatusTooManyRequests} {
			t.Run(fmt.Sprint(status), func(t *testing.T) {
				up := newUpstream(t)
				s := protectedSite(t, sb, up.Addr())
				c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Status": fmt.Sprint(status)}}
				wantExecuted(t, s.Do(t, c), status)
				c.Header = nil
				first := s.Do(t, c)
				wantExecuted(t, first, http.StatusCreated)
				wantReplayOf(t, s.Do(t, c), first)
				wantCount(t, up, 2)
			})
		}
	})
}

// store_status decides alone where it is given: listing 429 stores it.
func TestListedRefusalIsStored(t *testing.T) {
	up := newUpstream(t)
	s := protectedSite(t, storeBackend{Name: "memory"}, up.Addr(), "store_status 2xx 429")
	c := call{Key: newKey(), Body: payBody(), Header: map[string]string{"X-Test-Status": "429"}}
	first := s.Do(t, c)
	wantExecuted(t, first, http.StatusTooManyRequests)
	c.Header = nil
	wantReplayOf(t, s.Do(t, c), first)
	wantCount(t, up, 1)
}

// Made-up credentials that the upstream refuses leave no records.
func TestRefusedCredentialsLeaveNoRows(t *testing.T) {
	sb := postgresBackend(t)
	up := newUpstream(t)
	s := protectedSite(t, sb, up.Addr())
	for i := range 40 {
		c := call{Key: newKey(), Body: payBody(), Cred: fmt.Sprintf("Bearer made-up-%d", i), Header: map[string]string{"X-Test-Status": "401"}}
		wantExecuted(t, s.Do(t, c), http.StatusUnauthorized)
	}
	wantCount(t, up, 40)
	if n := pgCount(t, sb); n != 0 {
		t.Fatalf("%d rows after 40 refused requests, want none", n)
	}
}
