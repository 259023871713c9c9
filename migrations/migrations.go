// Package migrations holds the Postgres store's schema: numbered,
// forward-only SQL files, written for the default table name, so that a
// DBA can read them and apply them by hand with psql. The store applies
// them itself (migrate on), renamed for its table.
package migrations

import "embed"

// Files are the migrations, named NNNN_<what>.sql, at the root.
//
//go:embed *.sql
var Files embed.FS
