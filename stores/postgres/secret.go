package postgres

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/jackc/pgx/v5"
)

// secretTableSuffix names the table that keeps a Postgres table's default
// secret (migrations/0003).
const secretTableSuffix = "_secret"

// SecretTable is the quoted name of t's secret table, in t's schema.
func (t Table) SecretTable() string {
	return t.sibling(derivedName(t.name, secretTableSuffix))
}

// UseCredentialSecret implements SecretKeeper: the store reads the
// table's secret as it starts (startup.go).
func (s *Store) UseCredentialSecret() { s.tableSecret = true }

// CredentialSecret implements SecretKeeper: the table's secret, as the
// store read it when it started.
func (s *Store) CredentialSecret(ctx context.Context) ([]byte, error) {
	if err := s.Ready(ctx); err != nil {
		return nil, err
	}
	if s.start.secret == nil {
		// Hashing under no secret would be an unkeyed hash: fail closed.
		return nil, errors.New("postgres store: the credential secret was not read at start: no handler asked for it")
	}
	return s.start.secret, nil
}

// readCredentialSecret reads the table's secret, creating it if no
// instance has yet. ON CONFLICT DO NOTHING makes instances that start
// together agree on the first one's.
func (s *Store) readCredentialSecret(ctx context.Context) ([]byte, error) {
	fresh := make([]byte, store.MinSecretLen)
	_, _ = rand.Read(fresh)
	if _, err := s.pool.Exec(ctx, `INSERT INTO `+s.table.SecretTable()+` (secret) VALUES ($1) ON CONFLICT DO NOTHING`, unnamed, fresh); err != nil {
		return nil, fmt.Errorf("postgres store: credential secret: %w", err)
	}
	secret, err := storedCredentialSecret(ctx, s.pool, s.table)
	if err == nil && secret == nil {
		err = errors.New("the secret table is empty")
	}
	if err != nil {
		return nil, fmt.Errorf("postgres store: credential secret: %w", err)
	}
	return secret, nil
}

// StoredSecret reads the secret of the store's table; nil if there is
// none yet (no handler without credential_secret has used the table).
func (s *Store) StoredSecret(ctx context.Context) ([]byte, error) {
	return storedCredentialSecret(ctx, s.pool, s.table)
}

// storedCredentialSecret reads t's secret; nil if there is none yet.
func storedCredentialSecret(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, t Table) ([]byte, error) {
	var secret []byte
	err := db.QueryRow(ctx, `SELECT secret FROM `+t.SecretTable()+` WHERE id`, unnamed).Scan(&secret)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	return secret, err
}
