package postgres

// The store's table name: validated, quoted for SQL, and the names and
// advisory lock keys derived from it.

import (
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
)

// DefaultTable is the table name that the migration files spell out.
const DefaultTable = "idempotency_keys"

// Table is a validated table name, folded to lower case as Postgres
// folds an unquoted identifier, so that the name in the config means the
// table that a DBA's psql session means.
type Table struct {
	schema string // empty: the first schema of the search_path
	name   string
}

var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// ParseTable accepts "table" or "schema.table"; anything else could
// carry SQL into the statements, which cannot take the name as a parameter.
func ParseTable(s string) (Table, error) {
	parts := strings.Split(s, ".")
	if len(parts) > 2 {
		return Table{}, fmt.Errorf("table %q: at most one schema qualifier is allowed", s)
	}
	for _, p := range parts {
		if !identifier.MatchString(p) {
			return Table{}, fmt.Errorf("table %q: each part must be 1 to 63 letters, digits or underscores, not starting with a digit", s)
		}
	}
	t := Table{name: strings.ToLower(parts[len(parts)-1])}
	if len(parts) == 2 {
		t.schema = strings.ToLower(parts[0])
	}
	return t, nil
}

func (t Table) String() string {
	if t.schema == "" {
		return t.name
	}
	return t.schema + "." + t.name
}

// quoted returns the name ready for SQL text. Quoting is what keeps a
// name such as "user" or "order", valid but reserved, from breaking the
// statements.
func (t Table) quoted() string {
	return t.sibling(t.name)
}

// sibling returns the quoted name of the table name in t's schema.
func (t Table) sibling(name string) string {
	if t.schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{t.schema, name}.Sanitize()
}

// derivedName appends suffix to name within Postgres's 63-byte limit.
// Postgres would truncate a longer name, and two long table names sharing
// a prefix would then collide on their index names; a hash of the full
// name keeps them apart.
func derivedName(name, suffix string) string {
	const maxIdent = 63
	if len(name)+len(suffix) <= maxIdent {
		return name + suffix
	}
	h := fnv.New32a()
	h.Write([]byte(name))
	tag := fmt.Sprintf("_%08x", h.Sum32())
	return name[:maxIdent-len(suffix)-len(tag)] + tag + suffix
}

// PruneLockKey is the advisory lock that one pruner of t holds.
func (t Table) PruneLockKey() int64 {
	return advisoryKey("idempotency prune " + t.String())
}

// advisoryKey maps a name to a key for pg_advisory_lock. The name, not a
// bare number, makes a collision with another application's locks
// unlikely.
func advisoryKey(name string) int64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return int64(h.Sum64())
}
