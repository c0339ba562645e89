# zero: make test (vet + race tests), make demo (the benchmark table on the
# CPU), make bench (go test benchmarks), make cuda / make gpu-test (GPU path).
GO ?= go

.PHONY: test demo bench
test:
	$(GO) vet ./...
	$(GO) test -race -count=1 ./...

demo:
	$(GO) run ./cmd/demo

bench:
	$(GO) test -run '^$$' -bench . -benchtime 5x -count 1 .
