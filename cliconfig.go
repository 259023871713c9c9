package idempotency

// `caddy idempotency ... --config Caddyfile`: the CLI takes the store's
// DSN and table (and the handlers' credential_secret) from the config
// that Caddy runs, placeholders resolved, so that no secret is typed on
// a command line, where the shell's history and the process list keep it.

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/stores/postgres"
	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
)

// cliConfigStore is a Postgres store of a config, as its handlers use it.
type cliConfigStore struct {
	dsn   string // placeholders resolved
	table postgres.Table
	// secret is the handlers' credential_secret, resolved, if they all
	// have the same one; nil if none has one.
	secret []byte
	// secretsAgree is false when the handlers disagree on it: a raw
	// credential then needs --credential-secret.
	secretsAgree bool
	// secretErr is why a handler's credential_secret is refused, as the
	// server refuses it at start (unset, too short): a raw credential
	// cannot be hashed as the handlers would.
	secretErr error
	// lockTimeout is the longest lock_timeout of the handlers, which
	// judges a lease that a record from before migration 0002 lacks, as
	// their retries judge it.
	lockTimeout time.Duration
}

// cliStoreFromConfig finds the Postgres store of the config file that the
// flags name: the only one, or the one of --table.
func cliStoreFromConfig(fl caddycmd.Flags) (*cliConfigStore, error) {
	cfgJSON, _, _, err := caddycmd.LoadConfig(fl.String("config"), fl.String("adapter"))
	if err != nil {
		return nil, fmt.Errorf("--config: %v", err)
	}
	var cfg any
	dec := json.NewDecoder(bytes.NewReader(cfgJSON))
	dec.UseNumber()
	if err := dec.Decode(&cfg); err != nil {
		return nil, fmt.Errorf("--config: %v", err)
	}
	var stores []*cliConfigStore
	repl := caddy.NewReplacer()
	var walk func(v any) error
	walk = func(v any) error {
		switch v := v.(type) {
		case []any:
			for _, e := range v {
				if err := walk(e); err != nil {
					return err
				}
			}
		case map[string]any:
			if v["handler"] == "idempotency" {
				if err := addConfigStore(&stores, v, repl); err != nil {
					return err
				}
			}
			for _, e := range v {
				if err := walk(e); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(cfg); err != nil {
		return nil, err
	}
	slices.SortFunc(stores, func(a, b *cliConfigStore) int {
		return strings.Compare(a.table.String()+" "+postgres.DescribeDSN(a.dsn), b.table.String()+" "+postgres.DescribeDSN(b.dsn))
	})

	all := stores
	if fl.Changed("table") {
		// table@host:port/db tells apart tables of one name in two
		// databases, as the admin API names their stores.
		name, where, at := strings.Cut(fl.String("table"), "@")
		want, err := postgres.ParseTable(name)
		if err != nil {
			return nil, fmt.Errorf("--table: %v", err)
		}
		stores = slices.DeleteFunc(slices.Clone(stores), func(s *cliConfigStore) bool {
			return s.table != want || at && postgres.DescribeDSN(s.dsn) != where
		})
	}
	if len(stores) == 1 {
		return stores[0], nil
	}
	names := make([]string, len(all))
	for i, s := range all {
		names[i] = fmt.Sprintf("table %s in %s", s.table, postgres.DescribeDSN(s.dsn))
	}
	choose := "choose one with --table"
	for i := 1; i < len(stores); i++ {
		// Sorted by table: neighbours of one name are told apart by
		// their database only.
		if stores[i].table == stores[i-1].table {
			choose = "choose one with --table <table>, or --table <table>@<host:port/database> where two tables have one name"
			break
		}
	}
	switch {
	case len(all) == 0:
		return nil, fmt.Errorf("--config %s has no idempotency handler with a postgres store", fl.String("config"))
	case len(stores) == 0:
		return nil, fmt.Errorf("--config %s has no postgres store with table %s: it has %s", fl.String("config"), fl.String("table"), strings.Join(names, "; "))
	}
	return nil, fmt.Errorf("--config %s has %d postgres stores (%s): %s", fl.String("config"), len(stores), strings.Join(names, "; "), choose)
}

// addConfigStore adds the Postgres store of handler h, a handler's JSON
// object, to stores, or notes its credential_secret if it is there.
func addConfigStore(stores *[]*cliConfigStore, h map[string]any, repl *caddy.Replacer) error {
	store, _ := h["store"].(map[string]any)
	if store == nil || store["backend"] != "postgres" {
		return nil
	}
	rawDSN, _ := store["dsn"].(string)
	dsn := repl.ReplaceKnown(rawDSN, "")
	if dsn == "" {
		return fmt.Errorf("--config: the postgres store's dsn %q is empty once its placeholders are replaced: is its environment variable set?", rawDSN)
	}
	rawTable, _ := store["table"].(string)
	if rawTable == "" {
		rawTable = postgres.DefaultTable
	}
	table, err := postgres.ParseTable(rawTable)
	if err != nil {
		return fmt.Errorf("--config: %v", err)
	}
	var secret []byte
	var secretErr error
	if raw, _ := h["credential_secret"].(string); raw != "" {
		if secret, secretErr = resolveCredentialSecret(raw); secretErr != nil {
			secretErr = fmt.Errorf("--config: %w", secretErr)
		}
	}
	lockTimeout := defaultLockTimeout
	if raw, ok := h["lock_timeout"]; ok {
		js, _ := json.Marshal(raw)
		var d caddy.Duration
		if err := d.UnmarshalJSON(js); err != nil {
			return fmt.Errorf("--config: lock_timeout: %v", err)
		}
		lockTimeout = time.Duration(d)
	}
	for _, s := range *stores {
		if s.dsn == dsn && s.table == table {
			if !bytes.Equal(s.secret, secret) {
				s.secretsAgree = false
			}
			s.secretErr = cmp.Or(s.secretErr, secretErr)
			s.lockTimeout = max(s.lockTimeout, lockTimeout)
			return nil
		}
	}
	*stores = append(*stores, &cliConfigStore{dsn: dsn, table: table, secret: secret, secretsAgree: true, secretErr: secretErr, lockTimeout: lockTimeout})
	return nil
}

var errConfigAndDSN = errors.New("give --config or --dsn, not both: --config takes the dsn from the config")
