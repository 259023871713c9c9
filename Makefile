# The test command is the one README.md gives and .ci/run calls.
.PHONY: test caddy
test:
	go test -race -count=1 -timeout 30m ./...

caddy:
	go build -o caddy ./cmd/caddy

# The build a user makes from a clone or a fork: xcaddy with this
# directory as the module, at the Caddy version of go.mod. xcaddy is
# installed from the Go module proxy if it is not on PATH or in GOBIN.
# The replacement names a version, the module's own (version.go):
# without one, `go get` asks the proxy for the module's latest version,
# which an unpublished module or fork does not have; and the version
# named is the one `caddy list-modules --versions` shows.
XCADDY_VERSION ?= v0.4.5
GOBIN_DIR := $(shell go env GOBIN)
XCADDY := $(or $(shell command -v xcaddy),$(if $(GOBIN_DIR),$(GOBIN_DIR),$(shell go env GOPATH)/bin)/xcaddy)
CADDY_VERSION := $(shell go list -m -f '{{.Version}}' github.com/caddyserver/caddy/v2)
MODULE_VERSION := $(shell sed -n 's/^const Version = "\(.*\)"$$/\1/p' version.go)
.PHONY: xcaddy
xcaddy:
	test -x $(XCADDY) || go install github.com/caddyserver/xcaddy/cmd/xcaddy@$(XCADDY_VERSION)
	$(XCADDY) build $(CADDY_VERSION) --output ./caddy --with github.com/caddy-idempotency/idempotency@$(MODULE_VERSION)=.
	./caddy list-modules --versions | grep 'idempotency $(MODULE_VERSION)'

# The supported Caddy range (README, Building): go.mod requires the
# oldest, which `make test` runs against; CADDY_NEWEST is the newest
# release tested. test-caddy-newest runs the suite in a copy of the
# working tree whose go.mod requires the newest, with TEST_NEWEST_FLAGS
# (CI narrows it to the tests closest to Caddy's APIs: see .ci/run).
CADDY_NEWEST ?= v2.11.9
TEST_NEWEST_FLAGS ?=
.PHONY: test-caddy-range test-caddy-newest
test-caddy-range: test test-caddy-newest

test-caddy-newest:
	dir=$$(mktemp -d) && trap 'rm -rf "$$dir"' EXIT && \
	git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$$dir" && \
	cd "$$dir" && go get github.com/caddyserver/caddy/v2@$(CADDY_NEWEST) && go mod tidy && \
	go vet ./... && go test -race -count=1 -timeout 30m $(TEST_NEWEST_FLAGS) ./...

# The long runs, outside `make test`: the invariant with 20,000 keys against
# race-built Caddy processes, and each fuzz target for FUZZTIME.
.PHONY: soak fuzz
FUZZTIME ?= 1m
soak:
	IDEMPOTENCY_SOAK=1 IDEMPOTENCY_CADDY_RACE=1 go test -race -count=1 -run '^TestInvariantExactlyOnce$$' -v -timeout 60m .

fuzz:
	for f in FuzzParseKey FuzzFingerprintStreams FuzzCaddyfile FuzzRecorder FuzzKeyJSON; do \
		go test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) . || exit 1; \
	done
	go test -run '^$$' -fuzz '^FuzzCanonicalJSON$$' -fuzztime $(FUZZTIME) ./internal/canonjson

# The benchmark (bench/, docs/performance.md): every row side by side on
# this machine, with the ratios of issue 5, then the micro-benchmarks.
# Rows 2b and 3b go through PgBouncer, when it is installed.
# BENCH_DURATION, BENCH_CONCURRENCY and BENCH_DSN override the defaults.
.PHONY: bench bench-quick bench-scale bench-pools bench-micro
bench:
	go run ./bench/runner
	$(MAKE) bench-micro

bench-quick:
	go run ./bench/runner -quick

bench-scale:
	go run ./bench/runner -scale

bench-pools:
	go run ./bench/runner -pools 4,8,16,32

bench-micro:
	go test -run '^$$' -bench 'FingerprintJSON2KiB|CanonicalJSON|Recorder|Replay|FirstExecution|DecodeHeaderJSON' -benchmem -count 1 . ./internal/canonjson

# The failover figures of docs/high-availability.md: five runs on a
# synchronous standby (the test `make test` runs once), then asynchronous
# replication, without and with the standby held 1s behind.
.PHONY: failover
failover:
	go test -race -count=5 -run '^TestFailover$$' -v .
	IDEMPOTENCY_FAILOVER_ASYNC=1 go test -race -count=2 -run '^TestFailover$$' -v .
	IDEMPOTENCY_FAILOVER_ASYNC=1 IDEMPOTENCY_FAILOVER_LAG=1s go test -race -count=2 -run '^TestFailover$$' -v .

# The Patroni scenarios of docs/high-availability.md (build tag patroni):
# a switchover and a crash, at Patroni's default timings and at fast ones,
# each printing `<scenario>: N keys, E executed twice, L lost, recovery S s`.
# IDEMPOTENCY_PATRONI=crash-fast (comma-separated) runs some of them;
# PATRONI_COUNT=3 runs each three times.
PATRONI_COUNT ?= 1
.PHONY: failover-patroni
failover-patroni: SHELL := /bin/bash
failover-patroni:
	set -o pipefail; go test -tags patroni -race -count=$(PATRONI_COUNT) -run '^TestPatroniFailover$$' -v -timeout 90m . \
		| grep -E '^[a-z]+-[a-z]+: [0-9]+ keys|^(---|    ---|FAIL|ok)|_test.go:[0-9]+:'
