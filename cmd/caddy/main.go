// Command caddy is Caddy with the idempotency module built in, for
// development: `go build ./cmd/caddy`. Production builds use xcaddy.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddy-idempotency/idempotency"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

func main() {
	caddycmd.Main()
}
