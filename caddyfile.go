package idempotency

import (
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-idempotency/idempotency/internal/webhooksig"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("idempotency", parseCaddyfile)
	// After authentication (the credential must be known) and encode
	// (so the stored body is the identity one, and encode compresses
	// replays as it does first responses); before the handlers that
	// respond, which are what it protects.
	httpcaddyfile.RegisterDirectiveOrder("idempotency", httpcaddyfile.Before, "invoke")
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	handler := new(Handler)
	err := handler.UnmarshalCaddyfile(h.Dispenser)
	return handler, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	idempotency [<matcher>] {
//	    store postgres {
//	        dsn        <connection string>
//	        listen_dsn <connection string>
//	        table      <name>
//	        max_conns  <n>
//	        migrate    on|off
//	    }
//	    store memory [{ max_entries <n> }]
//	    key_header         <name>
//	    credential_header  <name>
//	    credential         <placeholder>
//	    credential_secret  <secret>
//	    methods            <method...>
//	    optional
//	    retention          <duration>
//	    lock_timeout       <duration>
//	    retry_after        <duration>
//	    max_request_body   <size>
//	    max_response_body  <size>
//	    request_body_budget <size>
//	    exclude_headers    <name...>
//	    prune_interval     <duration>
//	    execution_timeout  <duration>
//	    replay_cache       <size>|off
//	    wait               <duration>
//	    mismatch_status    409|422
//	    shadow
//	    on_store_error     fail_closed|fail_open
//	    scope              <name>
//	    key_json           <pointer>
//	    store_status       <status...>
//	    seal               on|off
//	    webhook            stripe|github|standard|shopify <secret...>
//	}
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	if d.NextArg() {
		return d.ArgErr()
	}

	seen := make(map[string]bool)
	for d.NextBlock(0) {
		name := d.Val()
		if seen[name] {
			return d.Errf("idempotency: %s given more than once", name)
		}
		seen[name] = true

		var err error
		switch name {
		case "store":
			err = h.unmarshalStore(d)
		case "key_header", "credential_header":
			dst := &h.KeyHeader
			if name == "credential_header" {
				dst = &h.CredentialHeader
			}
			if err = oneArg(d, dst); err == nil {
				if err := checkHeaderNames(name, *dst); err != nil {
					return d.Errf("idempotency: %v", err)
				}
			}
		case "credential":
			if err = oneArg(d, &h.Credential); err == nil {
				if err := checkCredentialPlaceholder(h.Credential); err != nil {
					return d.Errf("idempotency: %v", err)
				}
			}
		case "credential_secret":
			if err = oneArg(d, &h.CredentialSecret); err == nil && !hasPlaceholder(h.CredentialSecret) {
				if err := checkCredentialSecret(h.CredentialSecret); err != nil {
					return d.Errf("idempotency: %v", err)
				}
			}
		case "methods":
			h.Methods = d.RemainingArgs()
			if len(h.Methods) == 0 {
				return d.ArgErr()
			}
			if err := checkMethods(h.Methods); err != nil {
				return d.Errf("idempotency: %v", err)
			}
			for i, m := range h.Methods {
				h.Methods[i] = strings.ToUpper(m)
			}
		case "optional":
			if d.NextArg() {
				return d.ArgErr()
			}
			h.Optional = true
		case "retention":
			err = durationArg(d, &h.Retention, false, 0)
		case "lock_timeout":
			err = durationArg(d, &h.LockTimeout, false, minDuration)
		case "retry_after":
			err = durationArg(d, &h.RetryAfter, false, minDuration)
		case "execution_timeout":
			err = durationArg(d, &h.ExecutionTimeout, false, minDuration)
		case "prune_interval":
			var interval caddy.Duration
			err = durationArg(d, &interval, true, minDuration)
			h.PruneInterval = &interval
		case "max_request_body":
			err = sizeArg(d, &h.MaxRequestBody)
		case "max_response_body":
			err = sizeArg(d, &h.MaxResponseBody)
		case "request_body_budget":
			err = budgetArg(d, &h.RequestBodyBudget)
		case "replay_cache":
			err = replayCacheArg(d, &h.ReplayCache)
		case "exclude_headers":
			h.ExcludeHeaders = d.RemainingArgs()
			if len(h.ExcludeHeaders) == 0 {
				return d.ArgErr()
			}
			if err := checkHeaderNames("exclude_headers", h.ExcludeHeaders...); err != nil {
				return d.Errf("idempotency: %v", err)
			}
		case "wait":
			err = durationArg(d, &h.Wait, true, minWait)
		case "mismatch_status":
			var s string
			if !d.Args(&s) || d.NextArg() {
				return d.ArgErr()
			}
			n, convErr := strconv.Atoi(s)
			if convErr != nil {
				return d.Errf("idempotency: mismatch_status must be 409 or 422, not %q", s)
			}
			if err := checkMismatchStatus(n); err != nil {
				return d.Errf("idempotency: %v", err)
			}
			h.MismatchStatus = n
		case "shadow":
			if d.NextArg() {
				return d.ArgErr()
			}
			h.Shadow = true
		case "on_store_error":
			if err = oneArg(d, &h.OnStoreError); err == nil {
				if err := checkOnStoreError(h.OnStoreError); err != nil {
					return d.Errf("idempotency: %v", err)
				}
			}
		case "scope":
			err = oneArg(d, &h.Scope)
		case "key_json":
			if err = oneArg(d, &h.KeyJSON); err == nil {
				if _, err := parseJSONPointer(h.KeyJSON); err != nil {
					return d.Errf("idempotency: %v", err)
				}
			}
		case "store_status":
			h.StoreStatus = d.RemainingArgs()
			if len(h.StoreStatus) == 0 {
				return d.ArgErr()
			}
			if _, err := parseStoreStatus(h.StoreStatus); err != nil {
				return d.Errf("idempotency: %v", err)
			}
		case "webhook":
			args := d.RemainingArgs()
			if len(args) < 2 {
				return d.Errf("idempotency: webhook needs its provider (%s) and its signing secret, such as {env.STRIPE_WEBHOOK_SECRET}", strings.Join(webhooksig.Names(), ", "))
			}
			if _, ok := webhooksig.Senders[args[0]]; !ok {
				// Not quoted: a provider left out makes the first
				// argument a signing secret.
				return d.Errf("idempotency: webhook's first argument is not a provider: want one of %s, then the signing secrets", strings.Join(webhooksig.Names(), ", "))
			}
			h.Webhook = &WebhookConfig{Provider: args[0], Secrets: args[1:]}
		case "seal":
			var arg string
			if !d.AllArgs(&arg) {
				return d.ArgErr()
			}
			switch arg {
			case "on", "off":
				on := arg == "on"
				h.Seal = &on
			default:
				return d.Errf("idempotency: seal must be on or off, not %q", arg)
			}
		default:
			if backend, ok := storeOptions[name]; ok {
				return d.Errf("idempotency: %s belongs inside store %s { }", name, backend)
			}
			return d.Errf("idempotency: unrecognized subdirective %q", name)
		}
		if err != nil {
			return err
		}
	}
	if err := checkScope(h.Scope, h.Credential, h.CredentialHeader); err != nil {
		return d.Errf("idempotency: %v", err)
	}
	if err := checkKeyJSON(h.KeyJSON, h.KeyHeader); err != nil {
		return d.Errf("idempotency: %v", err)
	}
	return nil
}

// storeOptions are the options of the stores' blocks, by backend: one
// written in the handler's block instead gets told where it goes.
var storeOptions = map[string]string{
	"dsn": "postgres", "listen_dsn": "postgres", "table": "postgres", "max_conns": "postgres", "migrate": "postgres",
	"max_entries": "memory",
}

// unmarshalStore parses `store <backend> [{ ... }]`, handing the
// backend's own block to the backend module.
func (h *Handler) unmarshalStore(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.Errf("idempotency: store needs a backend: postgres or memory")
	}
	backend := d.Val()
	unm, err := caddyfile.UnmarshalModule(d, "http.handlers.idempotency.stores."+backend)
	if err != nil {
		if _, getErr := caddy.GetModule("http.handlers.idempotency.stores." + backend); getErr != nil {
			return d.Errf("idempotency: unknown store %q (want postgres or memory)", backend)
		}
		return err
	}
	h.StoreRaw = caddyconfig.JSONModuleObject(unm, "backend", backend, nil)
	return nil
}

func oneArg(d *caddyfile.Dispenser, dst *string) error {
	name := d.Val()
	if !d.NextArg() {
		return d.ArgErr()
	}
	*dst = d.Val()
	if d.NextArg() {
		return d.ArgErr()
	}
	if strings.TrimSpace(*dst) == "" {
		return d.Errf("idempotency: %s must not be empty", name)
	}
	return nil
}

// durationArg parses a duration that must be positive (or 0, if zeroOK)
// and, unless 0, at least floor.
func durationArg(d *caddyfile.Dispenser, dst *caddy.Duration, zeroOK bool, floor time.Duration) error {
	name := d.Val()
	var s string
	if !d.Args(&s) || d.NextArg() {
		return d.ArgErr()
	}
	dur, err := caddy.ParseDuration(s)
	if err != nil {
		return d.Errf("idempotency: %s: invalid duration %q: %v", name, s, err)
	}
	if dur < 0 || (dur == 0 && !zeroOK) {
		return d.Errf("idempotency: %s: duration must be positive, got %q", name, s)
	}
	if err := (durationFloor{name, dur, floor, zeroOK}).check(); err != nil {
		return d.Errf("idempotency: %v", err)
	}
	*dst = caddy.Duration(dur)
	return nil
}

func sizeArg(d *caddyfile.Dispenser, dst *int64) error {
	name := d.Val()
	var s string
	if !d.Args(&s) || d.NextArg() {
		return d.ArgErr()
	}
	n, err := humanize.ParseBytes(s)
	if err != nil {
		return d.Errf("idempotency: %s: invalid size %q: %v", name, s, err)
	}
	size := int64(min(n, math.MaxInt64))
	if err := checkBodySize(name, size); err != nil {
		return d.Errf("idempotency: %v", err)
	}
	*dst = size
	return nil
}

// budgetArg parses request_body_budget's size, which is the process's
// and may exceed the 2GiB of one body.
func budgetArg(d *caddyfile.Dispenser, dst *int64) error {
	var s string
	if !d.Args(&s) || d.NextArg() {
		return d.ArgErr()
	}
	n, err := humanize.ParseBytes(s)
	if err != nil || n == 0 || n > math.MaxInt64 {
		return d.Errf("idempotency: request_body_budget: invalid size %q (want a positive size such as 64MiB)", s)
	}
	*dst = int64(n)
	return nil
}

// replayCacheArg parses `replay_cache <size>|off`; 0 and off disable the
// cache.
func replayCacheArg(d *caddyfile.Dispenser, dst **int64) error {
	var s string
	if !d.Args(&s) || d.NextArg() {
		return d.ArgErr()
	}
	var n uint64
	if s != "off" {
		var err error
		if n, err = humanize.ParseBytes(s); err != nil || n > math.MaxInt64 {
			return d.Errf("idempotency: replay_cache: invalid size %q (want a size such as 4MiB, or off)", s)
		}
	}
	size := int64(n)
	*dst = &size
	return nil
}

// Interface guards
var _ caddyfile.Unmarshaler = (*Handler)(nil)
