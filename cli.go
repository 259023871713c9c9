package idempotency

// The operator CLI, `caddy idempotency migrate|prune|inspect|release`.
// It is a Caddy subcommand, registered by this package, so every binary
// built with the module has it: xcaddy builds and ./cmd/caddy alike. It
// works on the Postgres store only; the memory store lives and dies with
// its Caddy process.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddy-idempotency/idempotency/stores/postgres"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

// Exit codes of `caddy idempotency`.
const (
	exitOK       = 0
	exitError    = 1 // the database failed, or refused the change
	exitUsage    = 2 // bad flags or arguments: nothing was done
	exitNotFound = 3 // inspect or release: no such record
)

// cliListLimit bounds how many records inspect lists for one key and
// credential id prefix.
const cliListLimit = 20

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "idempotency",
		Usage: "migrate|prune|inspect|release|version [--config <Caddyfile> [--adapter <name>] | --dsn <connection string>] [--table <name>] ...",
		Short: "Operates the Postgres store of the idempotency handler",
		Long: `
Operates the Postgres store of the idempotency handler (http.handlers.idempotency):

  migrate   applies the embedded schema migrations (for stores with "migrate off")
  prune     deletes expired records, in batches
  inspect   shows the record of a key for a credential
  release   deletes a stuck in-progress record, so that its key can be retried
  version   prints the versions of this module and of Caddy

The database is --dsn, or else the environment variable IDEMPOTENCY_DSN, or
else DATABASE_URL. --table is the store's table (default idempotency_keys).
Or --config names the config that Caddy runs (a Caddyfile, or JSON with
--adapter ""), and the DSN, table and credential_secret come from its
postgres store, placeholders such as {env.DATABASE_URL} resolved; with
several postgres stores, --table chooses one.

A credential is named by --credential-id, the hex prefix of its keyed hash
that the handler's log lines print as credential_id, or by --credential, its
raw value (for example "Bearer sk_live_..."), which is hashed here and sent
nowhere, under the table's stored secret, or under --credential-secret when
the handlers are configured with credential_secret. A webhook route's records
are named by --scope, its scope (by default its webhook provider's name).

Exit codes: 0 done; 1 error (database unreachable, or the change refused);
2 usage error (nothing was done); 3 no such record (inspect, release).`,
		CobraFunc: func(cmd *cobra.Command) {
			pf := cmd.PersistentFlags()
			pf.String("dsn", "", "Postgres connection string (default $IDEMPOTENCY_DSN, then $DATABASE_URL)")
			pf.String("table", postgres.DefaultTable, "the store's table, as its table option; with --config, chooses among the config's stores (table@host:port/database where two have one name)")
			pf.String("config", "", "the config file that Caddy runs: its postgres store gives the dsn, table and credential_secret")
			pf.String("adapter", "", "the adapter of --config, as for caddy run (default: caddyfile for a file named Caddyfile* or *.caddyfile, else JSON)")
			cmd.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
				return cliUsageError(c, err)
			})
			cmd.RunE = func(c *cobra.Command, args []string) error {
				if len(args) > 0 {
					return cliUsageError(c, fmt.Errorf("unknown subcommand %q: want migrate, prune, inspect or release", args[0]))
				}
				return cliUsageError(c, errors.New("a subcommand is required: migrate, prune, inspect or release"))
			}
			cmd.AddCommand(cliMigrateCmd(), cliPruneCmd(), cliInspectCmd(), cliReleaseCmd(), cliVersionCmd())
		},
	})
}

// cliUsageError ends a command with exit code 2. It goes through Caddy's
// wrapper, which logs the error and carries the code to caddycmd.Main.
func cliUsageError(c *cobra.Command, err error) error {
	return caddycmd.WrapCommandFuncForCobra(func(caddycmd.Flags) (int, error) {
		return exitUsage, fmt.Errorf("%w (see %s --help)", err, c.CommandPath())
	})(c, nil)
}

// cliRunE adapts a subcommand to cobra: positional arguments are a usage
// error, the exit code goes to caddycmd.Main, and SIGINT stops the work
// cleanly (prune gives its lock back).
func cliRunE(run func(ctx context.Context, fl caddycmd.Flags, in io.Reader, out io.Writer) (int, error)) func(*cobra.Command, []string) error {
	return func(c *cobra.Command, args []string) error {
		if len(args) > 0 {
			return cliUsageError(c, fmt.Errorf("unexpected argument %q", args[0]))
		}
		return caddycmd.WrapCommandFuncForCobra(func(fl caddycmd.Flags) (int, error) {
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return run(ctx, fl, c.InOrStdin(), c.OutOrStdout())
		})(c, args)
	}
}

func cliMigrateCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "migrate",
		Short: "Applies the embedded schema migrations to the table",
		Long: `Applies the embedded schema migrations that the table has not had yet, under
the same advisory lock as Caddy's own start-up migration, so it is safe while
Caddy instances run. Needed when the store says "migrate off".`,
		RunE: cliRunE(func(ctx context.Context, fl caddycmd.Flags, _ io.Reader, out io.Writer) (int, error) {
			db, code, err := cliOpen(ctx, fl)
			if err != nil {
				return code, err
			}
			defer db.store.Close()
			n, err := db.store.ApplyMigrations(ctx)
			if err != nil {
				return exitError, err
			}
			fmt.Fprintf(out, "%s: applied %d migration(s); the schema is up to date\n", db.table, n)
			return exitOK, nil
		}),
	}
}

func cliPruneCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "prune",
		Short: "Deletes expired records",
		Long: `Deletes the records past their retention, in batches, under the same
advisory lock as the handlers' own pruning: if an instance is pruning the
table at the moment, this one says so and does nothing.`,
		RunE: cliRunE(func(ctx context.Context, fl caddycmd.Flags, _ io.Reader, out io.Writer) (int, error) {
			batch, err := fl.GetInt("batch")
			if err != nil || batch <= 0 {
				return exitUsage, fmt.Errorf("--batch must be a positive number of rows")
			}
			db, code, err := cliOpen(ctx, fl)
			if err != nil {
				return code, err
			}
			defer db.store.Close()
			n, locked, err := db.store.PruneLocked(ctx, batch)
			if err != nil {
				return exitError, db.explain(fmt.Errorf("pruned %d record(s), then: %w", n, err))
			}
			if !locked {
				fmt.Fprintf(out, "%s: another instance is pruning this table right now; nothing done\n", db.table)
				return exitOK, nil
			}
			fmt.Fprintf(out, "%s: pruned %d expired record(s)\n", db.table, n)
			return exitOK, nil
		}),
	}
	cmd.Flags().Int("batch", pruneBatchSize, "rows deleted per statement")
	return cmd
}

func cliInspectCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "inspect --key <key> --credential-id <hex> | --credential <value> | --scope <name>",
		Short: "Shows the record of a key for a credential",
		Long: `Shows the record of a key for a credential: its status, the request it
belongs to, when it was created and expires, and its response's status and
sizes. A credential id (the credential_id of log lines) is a prefix: every
record of the key whose credential hash starts with it is shown.`,
		RunE: cliRunE(func(ctx context.Context, fl caddycmd.Flags, in io.Reader, out io.Writer) (int, error) {
			target, err := cliParseTarget(fl, in)
			if err != nil {
				return exitUsage, err
			}
			db, code, err := cliOpen(ctx, fl)
			if err != nil {
				return code, err
			}
			defer db.store.Close()
			if err := db.hashCredential(ctx, &target); err != nil {
				return exitError, err
			}
			recs, err := db.store.InspectRecords(ctx, db.filter(target))
			if err != nil {
				return exitError, db.explain(err)
			}
			if len(recs) == 0 {
				return exitNotFound, target.notFound(db.table)
			}
			if fl.Bool("json") {
				// The admin API's records: the same fields.
				js := make([]recordJSON, len(recs))
				for i, ir := range recs {
					js[i] = newRecordJSON(ir, false)
				}
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return exitOK, enc.Encode(js)
			}
			for i, ir := range recs {
				if i > 0 {
					fmt.Fprintln(out)
				}
				printRecord(out, ir)
			}
			if len(recs) > 1 {
				fmt.Fprintf(out, "\n%d credentials match credential id %s; release needs a longer --credential-id (a credential_hash above) or --credential\n",
					len(recs), target.id)
			}
			return exitOK, nil
		}),
	}
	cliTargetFlags(cmd)
	cmd.Flags().Bool("json", false, "print the records as JSON")
	return cmd
}

func cliReleaseCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "release --key <key> --credential-id <hex> | --credential <value> | --scope <name> [--force]",
		Short: "Deletes a stuck in-progress record, so that its key can be retried",
		Long: `Deletes the in-progress record of a key for a credential whose owner is
gone, so that the client's next request with that key executes at once. It
is the admin API's release, by the rule of a takeover and a renewal: the
record's lease has ended by the database's clock. A record under a live
lease, whose request may still be running, is refused unless --force; then
its response will not be stored (its completion fails with
idempotency.lock_lost) and a retry executes the request again. The lock's
age and lease are printed before the release.

A completed record is kept unless --force: deleting it means that the next
request with its key executes again instead of being replayed.`,
		RunE: cliRunE(func(ctx context.Context, fl caddycmd.Flags, in io.Reader, out io.Writer) (int, error) {
			target, err := cliParseTarget(fl, in)
			if err != nil {
				return exitUsage, err
			}
			db, code, err := cliOpen(ctx, fl)
			if err != nil {
				return code, err
			}
			defer db.store.Close()
			if err := db.hashCredential(ctx, &target); err != nil {
				return exitError, err
			}
			return db.release(ctx, target, fl.Bool("force"), out)
		}),
	}
	cliTargetFlags(cmd)
	cmd.Flags().Bool("force", false, "delete the record even if it is completed, or in progress under a live lease")
	return cmd
}

func cliTargetFlags(cmd *cobra.Command) {
	cmd.Flags().String("key", "", "the Idempotency-Key, as the client sent it")
	cmd.Flags().String("credential-id", "", "the credential_id of the log lines: a hex prefix of the credential's keyed hash, 12 to 64 digits")
	cmd.Flags().String("credential", "", "the raw credential (e.g. the Authorization value), or - to read it from stdin; hashed here, sent nowhere")
	cmd.Flags().String("scope", "", "the scope of a webhook route (its scope, or its webhook provider's name), instead of a credential")
	cmd.Flags().String("credential-secret", "", "with --credential or --scope: the handlers' credential_secret, if they have one (placeholders such as {env.IDEMPOTENCY_SECRET} work); default: the table's stored secret")
}

// cliTarget names the records of one key whose credential hash starts
// with prefix. A target named by its raw credential has no prefix until
// hashCredential hashes it, under secret or the table's.
type cliTarget struct {
	key    string
	prefix []byte
	id     string // the prefix as the operator wrote it, for messages

	credential string
	// scope names a webhook route's records instead of a credential.
	scope  string
	secret []byte
}

func cliParseTarget(fl caddycmd.Flags, stdin io.Reader) (cliTarget, error) {
	raw := fl.String("key")
	if raw == "" {
		return cliTarget{}, errors.New("--key is required")
	}
	key, err := parseKey(raw)
	if err != nil {
		return cliTarget{}, fmt.Errorf("--key: %v", err)
	}
	id, credential, scope := fl.String("credential-id"), fl.String("credential"), fl.String("scope")
	switch {
	case given(id, credential, scope) > 1:
		return cliTarget{}, errors.New("give one of --credential-id, --credential and --scope")
	case credential != "" || scope != "":
		if credential == "-" {
			// A secret on the command line ends up in the shell's
			// history and in every user's view of the process list.
			line, err := bufio.NewReader(stdin).ReadString('\n')
			if err != nil && !(errors.Is(err, io.EOF) && line != "") {
				return cliTarget{}, fmt.Errorf("--credential -: reading the credential from stdin: %v", err)
			}
			credential = strings.TrimRight(line, "\r\n")
		}
		if credential == "" && scope == "" {
			return cliTarget{}, errors.New("--credential: the credential is empty")
		}
		target := cliTarget{key: key, credential: credential, scope: scope}
		if raw := fl.String("credential-secret"); raw != "" {
			secret, err := resolveCredentialSecret(raw)
			if err != nil {
				return cliTarget{}, fmt.Errorf("--credential-secret: %v", err)
			}
			target.secret = secret
		}
		return target, nil
	case fl.String("credential-secret") != "":
		return cliTarget{}, errors.New("--credential-secret goes with --credential or --scope: a credential id is hashed already")
	case id != "":
		prefix, err := parseCredentialID(id)
		if err != nil {
			return cliTarget{}, fmt.Errorf("--credential-id: %v", err)
		}
		return cliTarget{key: key, prefix: prefix, id: strings.ToLower(id)}, nil
	default:
		return cliTarget{}, errors.New("--credential-id (as the log lines print it), --credential or --scope is required")
	}
}

func (t cliTarget) notFound(table postgres.Table) error {
	if (t.credential != "" || t.scope != "") && t.secret == nil {
		return fmt.Errorf("%s: no record of key %q for credential id %s (hashed under the table's stored secret: if the handlers have credential_secret, pass it as --credential-secret)", table, t.key, t.id)
	}
	return fmt.Errorf("%s: no record of key %q for credential id %s", table, t.key, t.id)
}

// hashCredential hashes a target's raw credential as the handlers do.
func (db *cliDB) hashCredential(ctx context.Context, t *cliTarget) error {
	if t.credential == "" && t.scope == "" {
		return nil
	}
	secret := t.secret
	if secret == nil && db.config != nil && db.config.secretsAgree {
		if db.config.secretErr != nil {
			return db.config.secretErr
		}
		secret = db.config.secret
	}
	if secret == nil {
		stored, err := db.store.StoredSecret(ctx)
		if err != nil {
			return db.explain(fmt.Errorf("reading the credential secret: %w", err))
		}
		if stored == nil {
			return fmt.Errorf("%s has no stored credential secret: no handler without credential_secret has used it yet; if the handlers have credential_secret, pass it as --credential-secret", db.table)
		}
		secret = stored
	}
	hasher := newCredentialHasher(secret)
	var sum [32]byte
	if t.scope != "" {
		sum = scopeHash(hasher, t.scope)
	} else {
		sum = hasher.hash(t.credential)
	}
	t.prefix, t.id = sum[:], credentialID(sum)
	return nil
}

// cliDB is an open connection to the store's table.
type cliDB struct {
	table postgres.Table
	// store reads and releases records as the admin API does.
	store *postgres.Store
	// config is the store of --config, or nil.
	config *cliConfigStore
}

// cliOpen connects to the database that the flags or the environment
// name. Its errors come with their exit code.
func cliOpen(ctx context.Context, fl caddycmd.Flags) (*cliDB, int, error) {
	var config *cliConfigStore
	if fl.String("config") != "" {
		if fl.String("dsn") != "" {
			return nil, exitUsage, errConfigAndDSN
		}
		var err error
		if config, err = cliStoreFromConfig(fl); err != nil {
			return nil, exitUsage, err
		}
	}
	var table postgres.Table
	dsn := fl.String("dsn")
	if config != nil {
		dsn, table = config.dsn, config.table
	} else {
		var err error
		if table, err = postgres.ParseTable(fl.String("table")); err != nil {
			return nil, exitUsage, fmt.Errorf("--table: %v", err)
		}
	}
	for _, env := range []string{"IDEMPOTENCY_DSN", "DATABASE_URL"} {
		if dsn == "" {
			dsn = os.Getenv(env)
		}
	}
	if dsn == "" {
		return nil, exitUsage, errors.New("no database: pass --dsn, or set IDEMPOTENCY_DSN or DATABASE_URL")
	}
	st, err := postgres.Open(ctx, dsn, table, "caddy-idempotency-cli")
	if errors.Is(err, postgres.ErrDSN) {
		return nil, exitUsage, err
	} else if err != nil {
		return nil, exitError, err
	}
	return &cliDB{table: table, store: st, config: config}, exitOK, nil
}

// explain rewords the error of a table that does not exist.
func (db *cliDB) explain(err error) error {
	if postgres.UndefinedTable(err) {
		return fmt.Errorf("table %s does not exist: the store's table may have another name (pass it with --table, as the store's table option, or use --config); if it is a new store, create it with `caddy idempotency migrate --table %s`", db.table, db.table)
	}
	return err
}

// filter selects the records of t, as the admin API selects them: by
// the same implementation (inspect.go), the same rule judging a lease.
func (db *cliDB) filter(t cliTarget) store.RecordFilter {
	lockTimeout := defaultLockTimeout
	if db.config != nil {
		lockTimeout = db.config.lockTimeout
	}
	return store.RecordFilter{Key: t.key, CredentialPrefixes: [][]byte{t.prefix}, Limit: cliListLimit, LockTimeout: lockTimeout}
}

// printRecord shows ir as inspect does, its ages by the database's clock.
func printRecord(w io.Writer, ir store.InspectedRecord) {
	ago := func(t time.Time) string { return ir.Now.Sub(t).Round(time.Second).String() }
	status := string(ir.Record.Status)
	if ir.Record.Status == store.StatusInProgress {
		status += ", " + lockState(ir)
	}
	if ir.Expired {
		status += " (expired: treated as absent, awaiting pruning)"
	}
	fmt.Fprintf(w, "key:              %s\n", ir.Key.Key)
	fmt.Fprintf(w, "credential id:    %s\n", credentialID(ir.Key.CredentialHash))
	fmt.Fprintf(w, "credential hash:  %x\n", ir.Key.CredentialHash)
	fmt.Fprintf(w, "status:           %s\n", status)
	fmt.Fprintf(w, "request:          %s %s\n", ir.Record.Method, ir.Record.Path)
	fmt.Fprintf(w, "created:          %s (%s ago)\n", ir.Record.CreatedAt.Format(time.RFC3339), ago(ir.Record.CreatedAt))
	fmt.Fprintf(w, "expires:          %s (in %s)\n", ir.Record.ExpiresAt.Format(time.RFC3339), ir.Record.TTL.Round(time.Second))
	resp := ir.Record.Response
	if resp == nil {
		fmt.Fprintf(w, "response:         none yet\n")
		return
	}
	var body string
	switch {
	case resp.Sealed && resp.Replayable:
		body = fmt.Sprintf("%d bytes, stored sealed with its headers: replayable", resp.BodySize)
	case resp.Replayable && ir.StoredBody != nil:
		body = fmt.Sprintf("%d bytes, stored: replayable", *ir.StoredBody)
	case resp.BodySize > 0:
		body = fmt.Sprintf("%d bytes, too large to store: not replayable", resp.BodySize)
	default:
		body = "not stored: not replayable"
	}
	if resp.Sealed {
		fmt.Fprintf(w, "response:         %d; sealed; body %s\n", resp.Status, body)
		return
	}
	headers := 0
	if ir.StoredHeaders != nil {
		headers = *ir.StoredHeaders
	}
	fmt.Fprintf(w, "response:         %d; body %s; headers %d bytes stored\n", resp.Status, body, headers)
}

// release deletes the record of t as the admin API's release does
// (releaseRecord), and shows the lock it deleted.
func (db *cliDB) release(ctx context.Context, t cliTarget, force bool, out io.Writer) (int, error) {
	rec, err := releaseRecord(ctx, db.store, db.filter(t), force)
	switch {
	case errors.Is(err, store.ErrNoRecord):
		return exitNotFound, t.notFound(db.table)
	case errors.Is(err, errAmbiguous):
		return exitError, fmt.Errorf("credential id %s matches several credentials with key %q; nothing deleted: pass a longer --credential-id (see inspect) or --credential",
			t.id, t.key)
	case errors.Is(err, errCompleted):
		return exitError, fmt.Errorf("the record of key %q is %s, not in progress: its retries are replayed; nothing deleted (--force deletes it, and the next request with the key executes again)",
			t.key, rec.Record.Status)
	case errors.Is(err, errLeaseLive):
		return exitError, fmt.Errorf("the record of key %q is in progress under a live lease (%s): its request may still be running, and its owner renews the lease while it runs; nothing deleted (--force deletes it: the next request with the key then executes, possibly while the first one still runs, whose response is then not stored)",
			t.key, lockState(rec))
	case errors.Is(err, errChanged):
		return exitError, fmt.Errorf("the record of key %q changed meanwhile (completed, renewed or released); nothing deleted: inspect it again", t.key)
	case err != nil:
		return exitError, db.explain(err)
	}
	id := credentialID(rec.Key.CredentialHash)
	if rec.Record.Status == store.StatusInProgress {
		fmt.Fprintf(out, "%s: key %q for credential id %s was in progress, %s\n", db.table, t.key, id, lockState(rec))
	}
	fmt.Fprintf(out, "%s: released key %q for credential id %s: deleted its %s record; the next request with this key executes\n",
		db.table, t.key, id, rec.Record.Status)
	return exitOK, nil
}
