package idempotency

import (
	"os/exec"
	"strings"
	"testing"
)

// The walls between the packages, as the built Caddy has them: the
// handler reaches its stores through package store only, and pgx is the
// Postgres store's alone. Catches a handler file that imports a store's
// internals or pgx again, and a store that imports the handler.
func TestPackageWalls(t *testing.T) {
	const module = "github.com/caddy-idempotency/idempotency"
	out, err := exec.Command("go", "list", "-deps", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, "./cmd/caddy").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	var ours int
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		pkg, imports, _ := strings.Cut(line, " ")
		if pkg != module && !strings.HasPrefix(pkg, module+"/") {
			continue
		}
		ours++
		for _, imp := range strings.Fields(imports) {
			switch {
			case strings.HasPrefix(imp, "github.com/jackc/pgx") && pkg != module+"/stores/postgres":
				t.Errorf("%s imports %s: pgx belongs to the Postgres store alone", pkg, imp)
			case strings.HasPrefix(pkg, module+"/store") && imp == module:
				t.Errorf("%s imports the handler: the stores know the contract only", pkg)
			case pkg == module+"/store" && strings.HasPrefix(imp, module+"/") && !strings.HasPrefix(imp, module+"/internal/"):
				t.Errorf("package store imports %s: the contract uses neither the handler nor a store", imp)
			}
		}
	}
	if ours < 5 {
		t.Fatalf("only %d of the module's packages in the build of cmd/caddy:\n%s", ours, out)
	}
}
