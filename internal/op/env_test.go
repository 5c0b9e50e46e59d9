package op

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"testing"
)

// TestNewEnvDeferGPU checks that DeferGPU opens neither the CUDA driver nor NVML (a CPU-only
// checkpoint or restore never loads them) and that OpenGPU then does, once.
func TestNewEnvDeferGPU(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("NewEnvWith refuses a non-root caller; run as root")
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	env, closeEnv, err := NewEnvWith(context.Background(), "", log, EnvOptions{DeferGPU: true})
	if err != nil {
		t.Fatal(err)
	}
	defer closeEnv()
	if env.Driver != nil || env.DriverErr != nil || env.GPUs != nil {
		t.Fatalf("deferred: driver %v (%v), NVML %v; want nothing opened", env.Driver, env.DriverErr, env.GPUs)
	}
	if env.Host.Kernel == "" {
		t.Error("deferred: the host's kernel is not recorded")
	}
	env.OpenGPU()
	if (env.Driver == nil) == (env.DriverErr == nil) {
		t.Fatalf("after OpenGPU: driver %v, error %v; want exactly one", env.Driver, env.DriverErr)
	}
	driver, derr := env.Driver, env.DriverErr
	env.OpenGPU()
	if env.Driver != driver || env.DriverErr != derr {
		t.Error("a second OpenGPU opened again")
	}
}

// TestNewEnvInterrupted: a signal (the cancelled context) while the host is probed kills the
// probes; NewEnvWith says it was interrupted (exit 130 upstream), not that CRIU is unusable.
func TestNewEnvInterrupted(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("NewEnvWith refuses a non-root caller; run as root")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, closeEnv, err := NewEnvWith(ctx, "", slog.New(slog.NewTextHandler(io.Discard, nil)), EnvOptions{DeferGPU: true})
	closeEnv()
	if !errors.Is(err, context.Canceled) || errors.Is(err, ErrRefused) {
		t.Fatalf("NewEnvWith with a cancelled context: %v; want an interruption, not a refusal", err)
	}
}
