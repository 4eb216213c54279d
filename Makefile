# Thin wrappers around the go command; the README is the source of truth.

.PHONY: help test race lint bench fuzz demo modules snippets

help: ## list targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-6s %s\n", $$1, $$2}'

test: ## run the tests (starts a throwaway PostgreSQL)
	go test ./...

race: ## run the tests with the race detector, as CI does
	go test -race ./...

lint: ## gofmt, go vet and staticcheck
	@test -z "$$(gofmt -l .)" || (gofmt -l .; exit 1)
	go vet ./...
	staticcheck ./...

modules: ## vet, staticcheck and test -race every other module (integrations, their examples)
	@for m in $$(bash scripts/modules.sh); do echo "== $$m"; (cd $$m && go vet ./... && staticcheck ./... && go test -race ./...) || exit 1; done

snippets: ## check that the README's Go snippets match files that compile
	bash scripts/check-snippets.sh

bench: ## benchmarks of pgcoord against the raw pgx floor, in one run
	go test -run '^$$' -bench . -count 5 .

fuzz: ## fuzz key encoding and parsing for 30s each
	go test -run '^$$' -fuzz FuzzKeyRoundTrip -fuzztime 30s .
	go test -run '^$$' -fuzz FuzzParseKey -fuzztime 30s .
	go test -run '^$$' -fuzz FuzzHashInputUnambiguous -fuzztime 30s .

demo: ## the guided tour on a throwaway PostgreSQL
	go run ./examples/locks
