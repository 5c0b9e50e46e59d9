package op

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// mapFile maps a file at path (created with size bytes) into this process until the test ends:
// /proc/self/maps then lists it, as it lists a library the process loaded.
func mapFile(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m, err := syscall.Mmap(int(f.Fd()), 0, 4096, syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Munmap(m) })
}

// TestRefuseFrameworks: a process that maps JAX's runtime is refused when an image is asked for,
// and under the shim for a migrate too; without JAX nothing is refused.
func TestRefuseFrameworks(t *testing.T) {
	pid := os.Getpid()
	if err := RefuseFrameworks([]int{pid}, true); err != nil {
		t.Fatalf("no JAX mapped: %v", err)
	}
	dir := t.TempDir()
	mapFile(t, filepath.Join(dir, "site-packages", "jaxlib", "xla_extension.so"))
	if err := RefuseFrameworks([]int{pid}, true); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "CUDA_ERROR_NOT_INITIALIZED") {
		t.Fatalf("checkpoint of a JAX process: %v", err)
	}
	if err := RefuseFrameworks([]int{pid}, false); err != nil {
		t.Fatalf("migrate of a JAX process without the shim: %v", err)
	}
	mapFile(t, filepath.Join(dir, "lib", "libptxmig.so"))
	if err := RefuseFrameworks([]int{pid}, false); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "CUDA_ERROR_OPERATING_SYSTEM") {
		t.Fatalf("migrate of a JAX process under the shim: %v", err)
	}
}
