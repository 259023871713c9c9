package idempotency

import (
	"os"
	"testing"
)

// testDSN returns the connection string of the Postgres that tests use.
// Tests that need Postgres fail (never skip) when none can be found.
func testDSN(t testing.TB) string {
	t.Helper()
	if dsn := os.Getenv("IDEMPOTENCY_TEST_DSN"); dsn != "" {
		return dsn
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}
