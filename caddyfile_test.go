package idempotency

import (
	"fmt"
	"strings"
	"testing"
)

// A store option given outside the store's block is refused with where it
// belongs.
func TestStoreOptionOutsideItsBlock(t *testing.T) {
	for opt, store := range map[string]string{"dsn": "postgres", "table": "postgres", "max_conns": "postgres", "migrate": "postgres", "max_entries": "memory"} {
		_, _, err := adaptCaddyfile(fmt.Sprintf("http://127.0.0.1:8080 {\n\tidempotency {\n\t\t%s x\n\t}\n\treverse_proxy 127.0.0.1:9\n}\n", opt))
		if err == nil || !strings.Contains(err.Error(), opt+" belongs inside store "+store+" { }") || !strings.Contains(err.Error(), ":3") {
			t.Errorf("%s outside its block: %v, want where it belongs, on line 3", opt, err)
		}
	}
}
