// Package startup is the Caddy app "idempotency", which starts the stores
// of a config once Caddy runs it. Caddy provisions a config to validate
// it too (`caddy validate`, `caddy adapt --validate`, caddy.Validate),
// and then cancels it; it starts the apps only of a config it runs. The
// stores ask for this app (ctx.App, as the http app does for tls), so no
// config names it, and it has no settings.
package startup

import (
	"time"

	"github.com/caddy-idempotency/idempotency/store"
	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(App{})
}

// Group starts the stores of one kind in a config: the config's first
// store of that kind makes it (Join), and the others join it, so that a
// kind decides how its stores start together (one line for a table that
// several handlers share, one warning for the process's memory records).
type Group interface {
	// Start starts the group's stores in the background, and returns
	// a channel closed once each has ended its first attempt.
	Start() <-chan struct{}
}

// App starts the groups of a config's stores.
type App struct {
	kinds  []string
	groups map[string]Group
}

// CaddyModule returns the Caddy module information.
func (App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "idempotency",
		New: func() caddy.Module { return new(App) },
	}
}

// Join returns the group of kind in the config that ctx provisions, made
// by mk if the config has none yet, and whether this call made it. A
// store provisioned outside a config (a program's, a test's) has no
// group: Join returns nil and true, and the store starts at its first
// use.
func Join(ctx caddy.Context, kind string, mk func() Group) (g Group, first bool, err error) {
	if !InConfig(ctx) {
		return nil, true, nil
	}
	app, err := ctx.App("idempotency")
	if err != nil {
		return nil, false, err
	}
	a := app.(*App)
	if g, ok := a.groups[kind]; ok {
		return g, false, nil
	}
	if a.groups == nil {
		a.groups = map[string]Group{}
	}
	g = mk()
	a.kinds = append(a.kinds, kind)
	a.groups[kind] = g
	return g, true, nil
}

// Start starts the groups and waits, for at most one store call's
// timeout, for their first attempts: with the database up, a config is
// running with its tables migrated once it has loaded, and its first
// requests get no 503; with the database down, Caddy starts all the
// same.
func (a *App) Start() error {
	tried := make([]<-chan struct{}, 0, len(a.kinds))
	for _, k := range a.kinds {
		tried = append(tried, a.groups[k].Start())
	}
	timeout := time.NewTimer(store.CallTimeout)
	defer timeout.Stop()
	for _, c := range tried {
		select {
		case <-c:
		case <-timeout.C:
			return nil
		}
	}
	return nil
}

// Stop does nothing: the stores' attempts end with the config's context.
func (a *App) Stop() error { return nil }

// InConfig reports whether ctx provisions a module of a config's app:
// the app is the first of the modules it provisioned. Only then is there
// an app to ask for, and a Start to wait for.
func InConfig(ctx caddy.Context) bool {
	mods := ctx.Modules()
	if len(mods) == 0 {
		return false
	}
	_, ok := mods[0].(caddy.App)
	return ok
}

// Interface guards
var (
	_ caddy.App    = (*App)(nil)
	_ caddy.Module = (*App)(nil)
)
