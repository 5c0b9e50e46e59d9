# ptxmig build. `make` builds bin/ptxmig and bin/libptxmig.so; `make test` installs what the tests
# need (CRIU >= 4.0, ptxas) and runs everything that needs no GPU, ending with pass/skip/fail counts;
# `make lint` runs the static checks (CI runs both); `make gpu-test` runs the GPU suite.
GO        ?= go
PREFIX    ?= /usr/local
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
export PATH := /usr/local/go/bin:$(PATH)
export CGO_ENABLED := 1
# go-nvml's header marks many calls deprecated; the warnings are noise, not problems.
export CGO_CFLAGS := -O2 -Wno-deprecated-declarations
GOBUILD   := $(GO) build -trimpath -ldflags "-X main.version=$(VERSION)"
GO_SRCS   := $(shell find . -name '*.go' -not -path './dist/*' 2>/dev/null) go.mod go.sum
# What lint reads: the tree without dist/, build outputs and hidden directories (.git...).
LINT_PRUNE := \( -path ./dist -o -path ./bin -o -path ./shim/build -o -path './.*' \) -prune -o
LINT_GO   := $(shell find . $(LINT_PRUNE) -name '*.go' -print 2>/dev/null)
LINT_SH   := $(shell find . $(LINT_PRUNE) -name '*.sh' -print 2>/dev/null) .ci/run

.PHONY: all build shim deps lint lint-deps test test-go test-shim vet install demo gpu-bundle gpu-test clean

all: build
build: bin/ptxmig shim

bin/ptxmig: $(GO_SRCS)
	@mkdir -p bin
	$(GOBUILD) -o $@ ./cmd/ptxmig

shim:
	$(MAKE) -C shim

# Tools the tests use for real: CRIU (built from source when the system's is too old) and ptxas.
deps:
	@command -v $(GO) >/dev/null || { echo "make: Go not found; install Go >= 1.26 at /usr/local/go" >&2; exit 1; }
	@command -v gcc >/dev/null || { echo "make: gcc not found (apt-get install build-essential)" >&2; exit 1; }
	@# The shim's tests drive their apps from python3 and link one with c++.
	@command -v python3 >/dev/null && command -v c++ >/dev/null || \
		{ DEBIAN_FRONTEND=noninteractive apt-get -qq update && DEBIAN_FRONTEND=noninteractive apt-get -qq install -y python3 g++ >/dev/null; }
	scripts/install-criu.sh
	scripts/install-ptxas.sh

vet:
	$(GO) vet ./...

# Pinned lint tools: staticcheck (honnef.co/go/tools, version in the script) and Debian's shellcheck.
lint-deps:
	@scripts/install-lint.sh >/dev/null

# gofmt, go vet, staticcheck, go.mod/go.sum tidy, shellcheck on every *.sh. Every check runs; the
# target fails when any of them found something.
lint:
	@sc=$$(scripts/install-lint.sh) || exit 1; rc=0; \
	echo "lint: gofmt -l"; out=$$(gofmt -l $(LINT_GO)) || rc=1; \
	if [ -n "$$out" ]; then echo "$$out" | sed 's/^/    not gofmt-ed: /'; rc=1; fi; \
	echo "lint: go vet ./..."; $(GO) vet ./... || rc=1; \
	echo "lint: staticcheck ./..."; "$$sc" ./... || rc=1; \
	echo "lint: go mod tidy -diff"; $(GO) mod tidy -diff || { echo "    go.mod/go.sum are not tidy: run go mod tidy"; rc=1; }; \
	echo "lint: shellcheck"; shellcheck -x $(LINT_SH) || rc=1; \
	if [ $$rc -eq 0 ]; then echo "make lint: ok"; else echo "make lint: FAILED"; fi; exit $$rc

# go test -json through scripts/gotestsum: package lines, failing tests' output, skipped tests with
# their reasons, and "go: N passed, M skipped, K failed" (also in bin/test-go.summary).
test-go:
	@mkdir -p bin
	@$(GO) build -o bin/gotestsum ./scripts/gotestsum
	bin/gotestsum -summary bin/test-go.summary -- $(GO) test -race -count=1 -json ./...

# Ends with "shim: N passed, M skipped, K failed" (also in shim/build/test-summary).
test-shim:
	$(MAKE) -C shim test

# Both suites run even when the first fails; the last line sums them up.
test: deps build
	@rm -f bin/test-go.summary shim/build/test-summary; rc=0; \
	$(MAKE) --no-print-directory test-go || rc=1; \
	$(MAKE) --no-print-directory test-shim || rc=1; \
	go=$$(cat bin/test-go.summary 2>/dev/null || echo "go: did not run to the end"); \
	shim=$$(cat shim/build/test-summary 2>/dev/null || echo "shim: did not run to the end"); \
	if [ $$rc -eq 0 ]; then echo; echo "make test: passed ($$go; $$shim)"; \
	else echo; echo "make test: FAILED ($$go; $$shim)"; fi; exit $$rc

install: build
	install -D -m 0755 bin/ptxmig $(DESTDIR)$(PREFIX)/bin/ptxmig
	install -D -m 0755 bin/libptxmig.so $(DESTDIR)$(PREFIX)/lib/libptxmig.so

demo: deps build
	scripts/demo.sh

# Everything a GPU host needs (it has no Go toolchain and no network): dist/gpu/.
gpu-bundle: build
	scripts/gpu-bundle.sh dist/gpu

# Bundle, then run the GPU suite here (needs NVIDIA GPUs and nvcc on this host).
gpu-test: gpu-bundle
	cd dist/gpu && ./gpu-e2e.sh

clean:
	rm -rf bin dist
	$(MAKE) -C shim clean
