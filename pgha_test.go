package idempotency

import (
	"strings"
	"testing"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/store/storetest"
)

// The start of the warning that pgha.go logs.
const asyncWarning = "a failover of this database can lose records"

// TestAsyncReplicationWarning: a store whose primary replicates
// asynchronously says so at start, once.
func TestAsyncReplicationWarning(t *testing.T) {
	pair := pgtest.StartPair(t, false, 0)
	s := protectedSite(t, storeBackend{Name: "postgres", DSN: pair.DSN(), Table: "idempotency_keys"}, "")
	var line map[string]any
	storetest.WaitFor(t, 10*time.Second, "the replication warning", func() bool {
		for _, l := range s.moduleLogLines(t) {
			if msg, _ := l["msg"].(string); strings.HasPrefix(msg, asyncWarning) {
				line = l
				return true
			}
		}
		return false
	})
	if line["level"] != "warn" || line["synchronous_standby_names"] != "" || line["async_standbys"] == "" {
		t.Errorf("warning line %v: want level warn, synchronous_standby_names \"\", the standby named", line)
	}
	t.Logf("logged: %v", line)
}
