# The test command is the one README.md gives and .ci/run calls.
.PHONY: test caddy
test:
	go test -race -count=1 ./...

caddy:
	go build -o caddy ./cmd/caddy
