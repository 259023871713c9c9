# The test command is the one README.md gives and .ci/run calls.
.PHONY: test caddy
test:
	go test -race -count=1 ./...

caddy:
	go build -o caddy ./cmd/caddy

# The long runs, outside `make test`: the invariant with 20,000 keys against
# race-built Caddy processes, and each fuzz target for FUZZTIME.
.PHONY: soak fuzz
FUZZTIME ?= 1m
soak:
	IDEMPOTENCY_SOAK=1 IDEMPOTENCY_CADDY_RACE=1 go test -race -count=1 -run '^TestInvariantExactlyOnce$$' -v -timeout 60m .

fuzz:
	for f in FuzzParseKey FuzzCanonicalJSON FuzzCaddyfile FuzzRecorder; do \
		go test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) . || exit 1; \
	done

# The benchmark (bench/, docs/performance.md): every row side by side on
# this machine, with the ratios of issue 5, then the micro-benchmarks.
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
	go test -run '^$$' -bench 'FingerprintJSON2KiB|CanonicalJSON|Recorder|Replay|FirstExecution|DecodeHeaderJSON' -benchmem -count 1 .

# The failover figures of docs/high-availability.md: five runs on a
# synchronous standby (the test `make test` runs once), then asynchronous
# replication, without and with the standby held 1s behind.
.PHONY: failover
failover:
	go test -race -count=5 -run '^TestFailover$$' -v .
	IDEMPOTENCY_FAILOVER_ASYNC=1 go test -race -count=2 -run '^TestFailover$$' -v .
	IDEMPOTENCY_FAILOVER_ASYNC=1 IDEMPOTENCY_FAILOVER_LAG=1s go test -race -count=2 -run '^TestFailover$$' -v .
