# gpupool — see README.md. Every target installs what it needs.
SHELL := /bin/bash
GO    ?= go
BIN   := $(CURDIR)/bin
TOOLS := $(CURDIR)/.bin
PROTO_FILES := $(wildcard proto/gpupool/v1/*.proto)
# go-nvml's cgo prints deprecation warnings on every fresh build; they are not ours.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
PKG_RACE := ./broker/... ./agent/... ./client/... ./k8s/... ./protocol/... ./internal/... ./token/... ./dataplane/... ./cuda/...

.PHONY: cuda-toolkit bench-slowdisk bench-flood tmux test-dashboard chromium test-console bench-console all build install cc cuda-gen examples test-gpu test dev proto proto-check lint lint-refs bench bench-dataplane bench-cuda bench-placement bench-lease bench-failover bench-scale bench-churn bench-go tools clean test-unit test-cluster helm chart test-k8s bench-k8s elastic-demo fuzz test-robustness soak robustness-tools test-upgrade

all: build

# The version and commit 'gpupool version' prints, from git.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT  ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null)
LDFLAGS := -X github.com/gpupool/gpupool/internal/version.Version=$(VERSION) -X github.com/gpupool/gpupool/internal/version.Commit=$(COMMIT)
PREFIX  ?= /usr/local

build: cc ## build bin/gpupool (the product, stamped with the git version and commit), bin/gpupool-bench (the benchmarks, kept out of the product) and the CUDA shim bin/lib/libcuda.so.1
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/gpupool ./cmd/gpupool
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/gpupool-bench ./cmd/gpupool-bench
	$(GO) run ./cuda/shim/mkshim $(BIN)/lib >/dev/null

install: build ## install gpupool into $(PREFIX)/bin (default /usr/local; e.g. make install PREFIX=$$HOME/.local)
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 0755 $(BIN)/gpupool $(DESTDIR)$(PREFIX)/bin/gpupool
	@echo "installed $(DESTDIR)$(PREFIX)/bin/gpupool ($$($(DESTDIR)$(PREFIX)/bin/gpupool version | head -1))"

# gcc builds the CUDA shim (C, loaded into other people's programs) and the
# C test programs; installed from Debian when missing.
cc:
	@command -v gcc >/dev/null || { \
	  echo "installing gcc (Debian)"; \
	  (apt-get install -y -q gcc libc6-dev >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null && apt-get install -y -q gcc libc6-dev >/dev/null)); }

cuda-gen: ## regenerate the CUDA shim's stubs and the server's dispatch from cuda/api/cuda.api
	$(GO) generate ./cuda/api

examples: build ## build the C examples into bin/examples (vecadd: run it under 'gpupool attach')
	@mkdir -p $(BIN)/examples
	gcc -std=gnu11 -O2 -Wall -Wextra -Werror -I cuda/shim/csrc -o $(BIN)/examples/vecadd examples/cuda/vecadd.c -L $(BIN)/lib -lcuda

# Debian 12's CUDA toolkit 11.8 (nvcc, cudart, cuBLAS) from the non-free
# component, through a private sources list under .bin/apt, so the host's
# own apt configuration is left as it is. It brings NVIDIA's user-space
# libraries (libnvidia-ml1, libcuda1) as every GPU host has them: CI runs
# the suite with them present. About 1.3 GB and 3 minutes, once; a no-op
# when nvcc is already installed. Needs root; otherwise it says so.
CUDA_APT := $(TOOLS)/apt
CUDA_APT_OPTS = -o Dir::Etc::sourcelist=$(CUDA_APT)/sources.list -o Dir::Etc::sourceparts=$(CUDA_APT)/parts \
	-o Dir::State::Lists=$(CUDA_APT)/lists -o Dir::Cache::archives=$(CUDA_APT)/archives
cuda-toolkit: ## install Debian's nvidia-cuda-toolkit 11.8 (nvcc, cudart, libnvidia-ml) from non-free, once (root; about 3 minutes)
	@if dpkg-query -W -f='$${Status}' nvidia-cuda-toolkit 2>/dev/null | grep -q 'ok installed'; then \
	  echo "cuda-toolkit: $$(nvcc --version | tail -1) already installed"; \
	elif [ "$$(id -u)" != 0 ]; then \
	  echo "cuda-toolkit: not root, so Debian's CUDA toolkit is not installed (run 'sudo make cuda-toolkit')"; \
	else \
	  echo "cuda-toolkit: installing Debian's nvidia-cuda-toolkit from non-free (about 1.3 GB, 3 minutes)"; \
	  mkdir -p $(CUDA_APT)/parts $(CUDA_APT)/lists/partial $(CUDA_APT)/archives/partial && \
	  echo "deb http://deb.debian.org/debian bookworm main contrib non-free non-free-firmware" >$(CUDA_APT)/sources.list && \
	  apt-get $(CUDA_APT_OPTS) update -q >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get $(CUDA_APT_OPTS) install -y -q --no-install-recommends nvidia-cuda-toolkit >/dev/null && \
	  rm -rf $(CUDA_APT)/archives/*.deb && \
	  echo "cuda-toolkit: $$(nvcc --version | tail -1)"; \
	fi

# The shim's C test programs against the real backend on this machine's
# GPU (libcuda.so.1 from the driver); skips with a message where there is none.
test-gpu: cc ## the CUDA remoting tests and bench-cuda on a real GPU, with a table (skips without one)
	GPUPOOL_TEST_GPU=1 $(GO) test -count=1 -v -run 'TestRealGPU' ./cuda/shimtest
	@if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then \
	  $(MAKE) build && $(BIN)/gpupool-bench cuda --gpupool $(BIN)/gpupool --backend real --out bench/results/gpu; \
	else echo "test-gpu: no GPU on this machine (nvidia-smi -L): the benchmark on the real backend is skipped"; fi

dev: build ## run 3 brokers + 4 simulated hosts and show a lease's life; Ctrl-C stops
	$(BIN)/gpupool dev --demo

test: tools tmux cc proto-check lint chromium test-unit test-dashboard ## everything CI runs by default

test-unit:
	$(GO) test -race -count=1 -timeout 15m $(PKG_RACE)
	$(GO) test -count=1 -timeout 15m ./cmd/... ./proto/... ./bench/... ./examples/... ./test/...

# The Grafana dashboards (deploy/grafana) against the metrics a real broker
# and agent register: every query parses with Prometheus' own PromQL parser
# and names a metric that exists. Its own module (test/dashboard), so the
# product's go.mod does not carry the Prometheus server.
test-dashboard:
	cd test/dashboard && $(GO) vet ./... && $(GO) test -count=1 ./...

# The web console's browser suite (test/console, part of test-unit): Debian's
# Chromium, installed when missing, driven headless by chromedp against three
# broker processes and two simulated agents. Screenshots of every page go to
# .bin/console-screenshots; GPUPOOL_CONSOLE_UPDATE_DOCS=1 also refreshes
# docs/img/console-pool.png.
chromium: # Debian's chromium, installed when missing (the console's browser tests)
	@command -v chromium >/dev/null || { echo "installing chromium (Debian)"; \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null)) || \
	  echo "chromium: could not install it (not root?): test/console skips, or fails under CI"; }

test-console: chromium ## the web console in headless Chromium against a real cluster (about 1 min); screenshots in .bin/console-screenshots
	$(GO) test -count=1 -timeout 5m -v -run 'TestConsole' ./test/console

# The Kubernetes integration suite: its own module (test/k8s), which builds
# kube-apiserver, kube-scheduler and kube-controller-manager from
# k8s.io/kubernetes (about 5 minutes cold on 2 cores, seconds from Go's
# build cache) and runs them in the test binary on an embedded etcd.
# TestChart dry-run creates every object of the rendered chart (make chart)
# against that apiserver. TestBenchK8s skips unless GPUPOOL_BENCH_K8S=1.
# TestRealKubelet runs the kubelet of the same module, built here first
# (a tool of test/k8s/go.mod) so that its build does not count against the
# tests' timeout.
test-k8s: chart
	cd test/k8s && $(GO) build -o $(TOOLS)/kubelet k8s.io/kubernetes/cmd/kubelet
	cd test/k8s && GPUPOOL_CHART_RENDERED=$(CHART_RENDERED) GPUPOOL_KUBELET=$(TOOLS)/kubelet $(GO) test -count=1 -timeout 30m ./...

# 200 pods with fractional claims through our DRA driver against the same
# control plane, and the same pods with plain DRA allocation as a baseline;
# writes bench/results/k8s.md and bench/results/k8s.json (GPUPOOL_BENCH_PODS,
# GPUPOOL_BENCH_OUT override the pod count and the output directory).
bench-k8s: ## pod creation -> Leased=True / bound / prepared for 200 fractional pods (p50, p99); writes bench/results/k8s.{md,json}
	cd test/k8s && GPUPOOL_BENCH_K8S=1 $(GO) test -count=1 -run TestBenchK8s -timeout 30m -v .

# tmux drives 'gpupool top' in test/cluster (send-keys, capture-pane);
# Debian's, installed once.
tmux:
	@command -v tmux >/dev/null || { \
	  echo "installing tmux (Debian)"; \
	  (apt-get install -y -q tmux >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null && apt-get install -y -q tmux >/dev/null)); }

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

lint: lint-refs ## gofmt + go vet, and no reference to files outside the repository
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go') | grep -v '\.pb\.go$$' || true); \
	if [ -n "$$out" ]; then echo "gofmt wants to rewrite:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

# The repository stands alone: no file may cite a design document or a path
# that a fresh clone does not have. Names each offending file and line.
LINT_REFS := DESIG[N]\.md|(^|[^A-Za-z0-9_./-])/work/|\.\./share[d]
lint-refs: ## fail if any file cites the outside design document, /work/ or the parent's shared folder (not in a clone)
	@out=$$(grep -rInE '$(LINT_REFS)' --exclude-dir=.git --exclude=.git --exclude-dir=bin --exclude-dir=.bin . | grep -v '^./Makefile:' || true); \
	if [ -n "$$out" ]; then echo "references to files outside the repository:"; echo "$$out"; exit 1; fi

bench: build bench-placement bench-lease bench-failover bench-scale bench-dataplane ## every benchmark (about 20 minutes on 2 cores); writes bench/results/*.{json,md,png}; see bench/README.md

bench-placement: build ## the placement engine replays the four openb traces beside the FGD paper's reference (9 policies, 10 seeds), a mix-shift replay and the placement cost from 1k to 100k hosts; writes bench/results/placement*
	$(BIN)/gpupool-bench placement

bench-lease: build ## acquire+release on 3 gpupool brokers against an allocator on 3 etcd members, 1-256 clients (installs Debian's etcd-server; about 5 min)
	bash bench/lease/install-etcd.sh
	$(BIN)/gpupool-bench lease --gpupool $(BIN)/gpupool

bench-failover: build ## kill -9 the leader 10 times under load: time to the next acquire, leases lost (about 2 min)
	$(BIN)/gpupool-bench failover --gpupool $(BIN)/gpupool

bench-scale: build ## one broker with 10k hosts x 8 GPUs and 100k leases: RSS, snapshot, restart (about 10 min; at most 12)
	$(BIN)/gpupool-bench scale --gpupool $(BIN)/gpupool

bench-churn: build ## one broker's RSS at 0, 10k and 100k leases, then after 1M acquire/release cycles of churn (about 50 min on 2 cores: 2 to load, 46 of churn; the churn stops at 90 min and extrapolates); writes bench/results/churn.{json,md}
	$(BIN)/gpupool-bench churn --gpupool $(BIN)/gpupool

bench-console: build chromium ## the console's pool page on 10k hosts x 8 GPUs in headless Chromium: render and live-update times (about 2 min); writes bench/results/console.{json,md}
	$(BIN)/gpupool-bench console

bench-slowdisk: build ## one broker's Raft log writes slowed by 10ms, 100ms, 1s (a follower's, then the leader's) under acquire load on 3 brokers built with -tags faultinject (about 3 min); writes bench/results/slowdisk.{json,md}
	$(GO) build -tags faultinject -ldflags "$(LDFLAGS)" -o $(BIN)/gpupool-faultinject ./cmd/gpupool
	$(BIN)/gpupool-bench slowdisk --gpupool $(BIN)/gpupool-faultinject

bench-flood: build ## one token floods acquires and streams while another acquires (p99 with and without), and 8,000 waiting acquires of one tenant opened and cancelled (about 1 min); writes bench/results/flood.{json,md}
	$(BIN)/gpupool-bench flood

bench-go: ## Go micro-benchmarks of placement and the FSM
	$(GO) test -run '^$$' -bench . -benchmem ./broker/...

bench-cuda: build ## remote CUDA (shim, proxy, QUIC, the lease's server) against raw TCP and the data plane's get/put: null call p50/p99, pipelined launches/s, copies at 4 KiB/1 MiB/256 MiB, release to failure; writes bench/results/cuda.{json,md}
	$(BIN)/gpupool-bench cuda --gpupool $(BIN)/gpupool

bench-dataplane: build ## QUIC data plane against TCP+TLS on loopback: 1 GiB each way and exec latency; writes bench/results/dataplane.json
	$(BIN)/gpupool-bench dataplane

elastic-demo: ## examples/elastic-sim on a local 'gpupool dev' while guaranteed work comes and goes (about 2 minutes; ports 7641+ free); writes bench/results/elastic-sim.{png,csv}
	bash examples/elastic-sim/demo.sh

# Fuzz targets as PACKAGE:FUZZ_FUNC; their seed corpora are committed under
# each package's testdata/fuzz/. `make fuzz` runs each for FUZZTIME.
FUZZTIME ?= 10s
FUZZ_TARGETS := ./broker/fsm:FuzzDecode ./protocol:FuzzValidate ./token:FuzzVerify \
	./dataplane:FuzzReadFrame ./internal/quantity:FuzzParseMemoryMiB ./internal/quantity:FuzzParsePercent \
	./client:FuzzReadTokenFile ./agent:FuzzReadLeaseFile ./agent/device:FuzzSimControlProcess \
	./cuda/wire:FuzzReadFrame ./agent/cudaserver:FuzzSession ./agent/cudaserver:FuzzParseArg ./broker/console:FuzzParseFilters ./agent/sandbox:FuzzLeaseOf

fuzz: ## run every fuzz target for FUZZTIME each (default 10s): FSM commands, Acquire validation, lease tokens, data-plane frames, quantities
	@for t in $(FUZZ_TARGETS); do \
	  pkg=$${t%%:*}; fn=$${t##*:}; log=$$(mktemp); \
	  echo "==> $$fn ($$pkg, $(FUZZTIME))"; \
	  $(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) $$pkg >$$log 2>&1; rc=$$?; \
	  grep -v '^fuzz: elapsed' $$log; \
	  if [ $$rc != 0 ]; then \
	    if grep -q 'context deadline exceeded' $$log && ! grep -q -e 'Failing input written' -e '^panic:' -e '_test\.go:[0-9]*:' $$log; then \
	      echo "fuzz: $$fn: the fuzzing engine's own race at the end of -fuzztime (golang/go#75804, fixed in Go 1.27), no failing input; replaying the corpus"; \
	      $(GO) test -count=1 -run "^$$fn\$$" $$pkg || { rm -f $$log; exit 1; }; \
	    else rm -f $$log; exit 1; fi; \
	  fi; \
	  rm -f $$log; \
	done

# test/robustness: real brokers and simulated agents, each in a network
# namespace (root; else a TCP proxy, and the run says so), under seeded
# faults; every client operation is checked with porcupine. A run prints
# its seed; GPUPOOL_ROBUSTNESS_SEED=N repeats its choices. Logs, summaries
# and porcupine visualizations go to ROBUSTNESS_OUT.
ROBUSTNESS_OUT ?= $(TOOLS)/robustness
DURATION       ?= 10m
FAULTS         ?= random

robustness-tools: # ip, tc (iproute2) and iptables, installed from Debian when missing and we are root
	@if [ "$$(id -u)" = 0 ]; then \
	  for t in ip:iproute2 tc:iproute2 iptables:iptables; do \
	    command -v $${t%%:*} >/dev/null || { echo "installing $${t##*:} (Debian)"; \
	      (apt-get install -y -q $${t##*:} >/dev/null 2>&1 || \
	       (apt-get update -q >/dev/null && apt-get install -y -q $${t##*:} >/dev/null)); }; \
	  done; \
	else echo "robustness: not root, so no network namespaces: the runs use the TCP proxy"; fi

test-upgrade: ## build an older commit (git archive), run a 3-broker cluster of it with leases held, upgrade it one process at a time to this build (a few minutes)
	GPUPOOL_UPGRADE_TEST=1 $(GO) test -v -count=1 -timeout 20m -run 'TestRollingUpgrade' ./test/cluster | grep --line-buffered -v '^=== \(RUN\|PAUSE\|CONT\)'; exit $${PIPESTATUS[0]}

test-robustness: robustness-tools fuzz ## fuzz targets (FUZZTIME each), then a 60s fault run on 3 brokers + 3 agents checked by porcupine, and the cut-off-agent double-holder measurement (about 5 min)
	rm -rf $(ROBUSTNESS_OUT) && mkdir -p $(ROBUSTNESS_OUT)
	GPUPOOL_ROBUSTNESS=1 GPUPOOL_ROBUSTNESS_OUT=$(ROBUSTNESS_OUT) $(GO) test -v -count=1 -timeout 20m \
	  -run 'TestCheck|TestProxy|TestRobustness$$|TestCutOffAgent|TestPartitionedLeader' ./test/robustness | grep --line-buffered -v '^=== \(RUN\|PAUSE\|CONT\)'; exit $${PIPESTATUS[0]}
	@cat $(ROBUSTNESS_OUT)/TestRobustness/summary.txt $(ROBUSTNESS_OUT)/double-holder.md

soak: robustness-tools ## random faults (FAULTS=random, the default) or none (FAULTS=none: fails on any leader change) under mixed load on 5 brokers + 4 agents for DURATION (default 10m); ends with a summary table
	mkdir -p $(ROBUSTNESS_OUT)
	GPUPOOL_ROBUSTNESS=1 GPUPOOL_SOAK_DURATION=$(DURATION) GPUPOOL_SOAK_FAULTS=$(FAULTS) GPUPOOL_ROBUSTNESS_OUT=$(ROBUSTNESS_OUT) \
	  $(GO) test -v -count=1 -timeout 6h -run 'TestSoak$$' ./test/robustness | grep --line-buffered -v '^=== \(RUN\|PAUSE\|CONT\)'; exit $${PIPESTATUS[0]}
	@cat $(ROBUSTNESS_OUT)/TestSoak/summary.txt

# Helm, pinned, built from source through the Go module proxy (no binary
# download). `go install` skips Helm's own Makefile, which stamps the version
# and the Kubernetes version that `helm template` and `helm lint` assume
# (else v1.20): stamp them here, with the Kubernetes minor the chart targets.
HELM_VERSION    := v3.21.4
KUBE_MINOR      := 36
HELM            := $(TOOLS)/helm
HELM_LDFLAGS    := -X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION) \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$(KUBE_MINOR) \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$(KUBE_MINOR)
CHART           := deploy/helm/gpupool
CHART_NAMESPACE ?= gpupool-system
CHART_KUBE      := 1.$(KUBE_MINOR).0
CHART_RENDERED  := $(TOOLS)/chart-rendered.yaml

helm: ## install helm $(HELM_VERSION) into .bin (once; again only when the pin changes)
	@if [ "$$($(HELM) version --template '{{.Version}}' 2>/dev/null)" != "$(HELM_VERSION)" ]; then \
	  echo "installing helm $(HELM_VERSION) into $(TOOLS)"; \
	  GOBIN=$(TOOLS) $(GO) install -trimpath -ldflags '$(HELM_LDFLAGS)' helm.sh/helm/v3/cmd/helm@$(HELM_VERSION); \
	fi

chart: helm ## lint the Helm chart and render it into .bin/chart-rendered.yaml
	$(HELM) lint --strict --kube-version $(CHART_KUBE) --namespace $(CHART_NAMESPACE) $(CHART)
	@for f in $(CHART)/ci/*-values.yaml; do \
	  [ -e "$$f" ] || continue; \
	  echo "==> $$f"; \
	  $(HELM) lint --strict --kube-version $(CHART_KUBE) --namespace $(CHART_NAMESPACE) -f $$f $(CHART) || exit 1; \
	  $(HELM) template gpupool $(CHART) --kube-version $(CHART_KUBE) --namespace $(CHART_NAMESPACE) -f $$f >/dev/null || exit 1; \
	done
	$(HELM) template gpupool $(CHART) --kube-version $(CHART_KUBE) --namespace $(CHART_NAMESPACE) >$(CHART_RENDERED).tmp
	@mv $(CHART_RENDERED).tmp $(CHART_RENDERED)
	@echo "chart: rendered $$(grep -c '^kind:' $(CHART_RENDERED)) objects into $(CHART_RENDERED)"

clean:
	rm -rf $(BIN) $(TOOLS)
