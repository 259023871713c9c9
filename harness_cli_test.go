package idempotency

// The CLI (`caddy idempotency ...`), run as a user runs it: the built
// Caddy binary, in a process of its own.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

// ---------------------------------------------------------------------------
// The CLI and the metrics

// cliResult is what one run of the CLI printed and returned.
type cliResult struct {
	stdout, stderr string
	code           int
}

func (r cliResult) String() string {
	return fmt.Sprintf("exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
}

// runCLI runs `caddy idempotency args...` with env as the only
// database-related environment (IDEMPOTENCY_DSN and DATABASE_URL of the
// test process are not passed on).
func runCLI(t *testing.T, env []string, args ...string) cliResult {
	t.Helper()
	return runCLIInput(t, "", env, args...)
}

// runCLIInput is runCLI with stdin.
func runCLIInput(t *testing.T, stdin string, env []string, args ...string) cliResult {
	t.Helper()
	bin := buildCaddy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, append([]string{"idempotency"}, args...)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMPOTENCY_DSN=") && !strings.HasPrefix(kv, "DATABASE_URL=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = strings.NewReader(stdin), &stdout, &stderr
	err := cmd.Run()
	res := cliResult{stdout: stdout.String(), stderr: stderr.String()}
	var exitErr *exec.ExitError
	switch {
	case errors.As(err, &exitErr):
		res.code = exitErr.ExitCode()
	case err != nil:
		t.Fatalf("running %s: %v", bin, err)
	}
	return res
}

func wantCLI(t *testing.T, res cliResult, code int, contains ...string) {
	t.Helper()
	if res.code != code {
		t.Fatalf("want exit %d, got %s", code, res)
	}
	for _, s := range contains {
		if !strings.Contains(res.stdout+res.stderr, s) {
			t.Errorf("output lacks %q: %s", s, res)
		}
	}
}
