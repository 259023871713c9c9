package idempotency

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/caddy-idempotency/idempotency/internal/pgtest"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
	"github.com/jackc/pgx/v5/pgconn"
)

// `--config`: the CLI takes the DSN ({env.X} resolved), the table and
// the handlers' credential_secret from the Caddyfile that Caddy runs,
// and asks which store is meant when the config has several.
func TestCLIConfig(t *testing.T) {
	dsn := pgtest.DSN(t)
	sb := postgresBackend(t)
	other := pgtest.FreshTable(t)
	const secret = "a-credential-secret-of-32-bytes-or-more"
	up := newUpstream(t)
	s := protectedSite(t, sb, up.Addr(), "credential_secret "+secret)
	c := call{Key: newKey(), Body: payBody()}
	wantExecuted(t, s.Do(t, c), http.StatusCreated)

	site := func(port int, table string) string {
		return fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		store postgres {
			dsn {env.TEST_IDEMPOTENCY_DSN}
			table %s
		}
		credential_secret {env.TEST_IDEMPOTENCY_SECRET}
	}
	respond "ok"
}
`, port, table)
	}
	dir := t.TempDir()
	one := filepath.Join(dir, "Caddyfile")
	two := filepath.Join(dir, "two.caddyfile")
	if err := os.WriteFile(one, []byte(site(1, sb.Table)), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(two, []byte(site(1, sb.Table)+site(2, other)), 0o600); err != nil {
		t.Fatal(err)
	}
	env := []string{"TEST_IDEMPOTENCY_DSN=" + dsn, "TEST_IDEMPOTENCY_SECRET=" + secret}
	target := []string{"--key", c.Key, "--credential", "-"}

	// The raw credential is hashed under the config's secret.
	wantCLI(t, runCLIInput(t, defaultCred+"\n", env, append([]string{"inspect", "--config", one}, target...)...),
		exitOK, "status:           completed")
	wantCLI(t, runCLIInput(t, defaultCred+"\n", env, append([]string{"inspect", "--config", one, "--adapter", "caddyfile"}, target...)...),
		exitOK, "status:           completed")

	// Two stores: the CLI names them, and --table chooses.
	res := runCLIInput(t, defaultCred+"\n", env, append([]string{"inspect", "--config", two}, target...)...)
	wantCLI(t, res, exitUsage, "2 postgres stores", sb.Table, other, "--table")
	if strings.Contains(res.stdout+res.stderr, dsn) {
		t.Errorf("the CLI prints the dsn: %s", res)
	}
	wantCLI(t, runCLIInput(t, defaultCred+"\n", env, append([]string{"inspect", "--config", two, "--table", sb.Table}, target...)...),
		exitOK, "status:           completed")
	wantCLI(t, runCLIInput(t, defaultCred+"\n", env, append([]string{"inspect", "--config", two, "--table", "nonesuch"}, target...)...),
		exitUsage, "no postgres store with table nonesuch")
	wantCLI(t, runCLI(t, env, "migrate", "--config", two, "--table", other), exitOK, other+": applied")
	wantCLI(t, runCLI(t, env, "prune", "--config", two, "--table", other), exitOK, other+": pruned 0")

	// Two tables of one name, in two databases: the database chooses.
	// The other database's store is never connected to.
	pc, err := pgconn.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	otherDB := fmt.Sprintf("postgres://%s@%s/postgres?sslmode=disable", pc.User, net.JoinHostPort(pc.Host, strconv.Itoa(int(pc.Port))))
	same := filepath.Join(dir, "same.caddyfile")
	if err := os.WriteFile(same, []byte(site(1, sb.Table)+strings.Replace(site(2, sb.Table), "TEST_IDEMPOTENCY_DSN", "TEST_OTHER_DSN", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	sameEnv := append(env, "TEST_OTHER_DSN="+otherDB)
	wantCLI(t, runCLIInput(t, defaultCred+"\n", sameEnv, append([]string{"inspect", "--config", same, "--table", sb.Table}, target...)...),
		exitUsage, "2 postgres stores", "--table <table>@<host:port/database>")
	wantCLI(t, runCLIInput(t, defaultCred+"\n", sameEnv, append([]string{"inspect", "--config", same, "--table", sb.Table + "@" + postgres.DescribeDSN(dsn)}, target...)...),
		exitOK, "status:           completed")

	// Without the environment variable, the DSN is empty: said, not tried.
	wantCLI(t, runCLIInput(t, defaultCred+"\n", nil, append([]string{"inspect", "--config", one}, target...)...),
		exitUsage, "is its environment variable set")
	wantCLI(t, runCLI(t, env, "migrate", "--config", one, "--dsn", dsn), exitUsage, "not both")
}

// A credential_secret that --config resolves to nothing, or to a secret
// too short, is refused as the server refuses it, naming its placeholder:
// hashing under "" or "short" finds no record, and would say so under
// the table's stored secret, which was not used. The server names the
// placeholder too; and a table missing under the default name may have
// another.
func TestCLIConfigSecretChecked(t *testing.T) {
	dsn := pgtest.DSN(t)
	sb := postgresBackend(t)
	wantCLI(t, runCLI(t, []string{"IDEMPOTENCY_DSN=" + dsn}, "migrate", "--table", sb.Table), exitOK)
	config := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(config, []byte(fmt.Sprintf(`http://127.0.0.1:1 {
	idempotency {
		store postgres {
			dsn {env.TEST_IDEMPOTENCY_DSN}
			table %s
		}
		credential_secret {env.TEST_IDEMPOTENCY_A4_SECRET}
	}
	respond "ok"
}
`, sb.Table)), 0o600); err != nil {
		t.Fatal(err)
	}
	target := []string{"inspect", "--config", config, "--key", newKey(), "--credential", "-"}
	for secret, want := range map[string]string{"": "is empty", "short": "5 bytes, fewer than 32"} {
		env := []string{"TEST_IDEMPOTENCY_DSN=" + dsn}
		if secret != "" {
			env = append(env, "TEST_IDEMPOTENCY_A4_SECRET="+secret)
		}
		res := runCLIInput(t, defaultCred+"\n", env, target...)
		wantCLI(t, res, exitError, "credential_secret {env.TEST_IDEMPOTENCY_A4_SECRET}", want)
		if strings.Contains(res.stdout+res.stderr, "no record") {
			t.Errorf("secret %q: the CLI looked the record up: %s", secret, res)
		}
	}

	t.Setenv("TEST_IDEMPOTENCY_A4_SECRET", "")
	err := loadErr(t, fmt.Sprintf(`http://127.0.0.1:%d {
	idempotency {
		credential_secret {env.TEST_IDEMPOTENCY_A4_SECRET}
	}
	respond "ok"
}
`, freeTCPPort(t)))
	if !strings.Contains(err.Error(), "credential_secret {env.TEST_IDEMPOTENCY_A4_SECRET} is empty") {
		t.Errorf("load error %v, want one naming the placeholder", err)
	}

	missing := pgtest.FreshTable(t)
	wantCLI(t, runCLI(t, []string{"IDEMPOTENCY_DSN=" + dsn}, "prune", "--table", missing), exitError,
		missing+" does not exist", "another name", "--table")
}
