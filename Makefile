# gpupool — see README.md. Every target installs what it needs.
SHELL := /bin/bash
GO    ?= go
BIN   := $(CURDIR)/bin
TOOLS := $(CURDIR)/.bin
PROTO_FILES := $(wildcard proto/gpupool/v1/*.proto)
# go-nvml's cgo prints deprecation warnings on every fresh build; they are not ours.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
PKG_RACE := ./broker/... ./agent/... ./client/... ./internal/... ./token/... ./dataplane/...

.PHONY: all build test dev proto proto-check lint bench bench-dataplane tools clean test-unit test-cluster

all: build

build: ## build bin/gpupool
	$(GO) build -o $(BIN)/gpupool ./cmd/gpupool

dev: build ## run 3 brokers + 4 simulated hosts and show a lease's life; Ctrl-C stops
	$(BIN)/gpupool dev --demo

test: tools proto-check lint test-unit ## everything CI runs by default

test-unit:
	$(GO) test -race -count=1 -timeout 15m $(PKG_RACE)
	$(GO) test -count=1 -timeout 15m ./cmd/... ./proto/... ./bench/... ./test/...

# protoc comes from Debian (pinned by the distribution); the Go plugins are
# pinned as tools in go.mod.
tools: $(TOOLS)/protoc-gen-go $(TOOLS)/protoc-gen-go-grpc
	@command -v protoc >/dev/null || { \
	  echo "installing protoc (Debian protobuf-compiler)"; \
	  (apt-get install -y -q protobuf-compiler >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null && apt-get install -y -q protobuf-compiler >/dev/null)); }

$(TOOLS)/protoc-gen-go $(TOOLS)/protoc-gen-go-grpc: go.mod go.sum
	GOBIN=$(TOOLS) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go google.golang.org/grpc/cmd/protoc-gen-go-grpc

proto: tools ## regenerate the Go code from proto/
	PATH=$(TOOLS):$$PATH protoc -I proto \
	  --go_out=. --go_opt=module=github.com/gpupool/gpupool \
	  --go-grpc_out=. --go-grpc_opt=module=github.com/gpupool/gpupool \
	  $(PROTO_FILES)

# Fails when the committed generated code is not what the .proto files and
# the pinned plugins produce. The protoc version comment is ignored.
proto-check: tools
	@tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; stale=0; \
	PATH=$(TOOLS):$$PATH protoc -I proto \
	  --go_out=$$tmp --go_opt=module=github.com/gpupool/gpupool \
	  --go-grpc_out=$$tmp --go-grpc_opt=module=github.com/gpupool/gpupool \
	  $(PROTO_FILES) || exit 1; \
	for f in $$(cd $$tmp && find proto -name '*.go'); do \
	  diff -u -I '^// \(- \)\?protoc ' $$tmp/$$f $$f | head -20 || true; \
	  diff -q -I '^// \(- \)\?protoc ' $$tmp/$$f $$f >/dev/null 2>&1 || stale=1; \
	done; \
	for f in $$(find proto -name '*.pb.go'); do [ -f $$tmp/$$f ] || { echo "$$f has no .proto source"; stale=1; }; done; \
	if [ $$stale = 1 ]; then echo "proto-check: generated code is stale; run 'make proto' and commit the result"; exit 1; fi; \
	echo "proto-check: generated code is up to date"

lint: ## gofmt + go vet
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go') | grep -v '\.pb\.go$$' || true); \
	if [ -n "$$out" ]; then echo "gofmt wants to rewrite:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

bench: bench-dataplane ## Go benchmarks of placement and the FSM, and the data-plane benchmark (the full harness is tracked in issue 7)
	$(GO) test -run '^$$' -bench . -benchmem ./broker/...

bench-dataplane: ## QUIC data plane against TCP+TLS on loopback: 1 GiB each way and exec latency; writes bench/results/dataplane.json
	$(GO) run ./bench/dataplane

clean:
	rm -rf $(BIN) $(TOOLS)
