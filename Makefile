# ptxmig build. `make` builds bin/ptxmig and bin/libptxmig.so; `make test` installs what the tests
# need (CRIU >= 4.0, ptxas) and runs everything that needs no GPU; `make gpu-test` runs the GPU suite.
GO        ?= go
PREFIX    ?= /usr/local
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
export PATH := /usr/local/go/bin:$(PATH)
export CGO_ENABLED := 1
# go-nvml's header marks many calls deprecated; the warnings are noise, not problems.
export CGO_CFLAGS := -O2 -Wno-deprecated-declarations
GOBUILD   := $(GO) build -trimpath -ldflags "-X main.version=$(VERSION)"
GO_SRCS   := $(shell find . -name '*.go' -not -path './dist/*' 2>/dev/null) go.mod go.sum

.PHONY: all build shim deps test test-go test-shim vet install demo gpu-bundle gpu-test clean

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

test-go:
	$(GO) test -race -count=1 ./...

test-shim:
	$(MAKE) -C shim test

test: deps build vet test-go test-shim
	@echo "make test: all passed"

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
