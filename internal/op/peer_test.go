package op

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
)

// TestRefuseUnrestorable: a process whose shim reports peer links, or GPU memory exported to or
// imported from another process, is refused (a refusal: exit 3, nothing touched) with a message
// naming the pid, what was found, why and the way out; no shim, a shim reporting none, an older
// shim without the fields, or a shim that does not answer lets the operation go ahead.
func TestRefuseUnrestorable(t *testing.T) {
	pid := os.Getpid()
	status := func(fields string) map[string]string {
		return map[string]string{"status": reply("status", fmt.Sprintf(`{"pid":%d,"proto":2%s}`, pid, fields), 2)}
	}
	ipc := func(exp, imp int, kinds string) string {
		return fmt.Sprintf(`,"peer_access":0,"ipc":{"exported":%d,"imported":%d,%s"export_calls":9,"import_calls":9,`+
			`"untracked":{"exported":0,"imported":0}}`, exp, imp, kinds)
	}
	peerWhy := []string{"has enabled peer access between its GPUs (2 link(s), reported by the ptxmig shim)",
		"CUDA_ERROR_INVALID_VALUE", "nothing was touched", "cuCtxDisablePeerAccess", "NCCL_P2P_DISABLE=1"}
	shareWhy := []string{"shares GPU memory with other processes", "reported by the ptxmig shim",
		"cuCheckpointProcessRestore fails with CUDA_ERROR_NOT_SUPPORTED", "--leave-running checkpoint cannot roll back",
		"2x H200, driver 580.159.04", "PyTorch DDP rank using NCCL's default transports", "nothing was touched",
		"NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_CUMEM_ENABLE=0", "through sockets",
		"stop sharing GPU memory between processes"}
	tests := []struct {
		name    string
		replies map[string]string // nil: no socket at all
		want    []string          // nil: not refused
		notWant []string
	}{
		{name: "no shim"},
		{name: "nothing shared", replies: status(ipc(0, 0, ""))},
		{name: "an older shim without the fields", replies: status("")},
		{name: "garbled status", replies: map[string]string{"status": "{nope\n"}},
		{name: "peer links", replies: status(`,"peer_access":2,"ipc":{"exported":0,"imported":0}`),
			want: append([]string{fmt.Sprintf("pid %d has enabled peer access", pid)}, peerWhy...), notWant: []string{"shares GPU memory"}},
		{name: "peer links from a shim without ipc", replies: status(`,"peer_access":2`), want: peerWhy},
		{name: "peer links the shim turns off for the checkpoint", replies: status(`,"peer_access":2,"peer_toggle":true,"ipc":{"exported":0,"imported":0}`)},
		// Driver 580 cannot enable peer access toward a context holding a cuMemAlloc allocation
		// over 256 MiB after a restore: 256 MiB goes ahead, 512 MiB is refused.
		{name: "peer links the shim turns off, 256 MiB allocation",
			replies: status(`,"peer_access":2,"peer_toggle":true,"largest_device_alloc":268435456,"ipc":{"exported":0,"imported":0}`)},
		{name: "peer links the shim turns off, 512 MiB allocation",
			replies: status(`,"peer_access":2,"peer_toggle":true,"largest_device_alloc":536870912,"ipc":{"exported":0,"imported":0}`),
			want: []string{fmt.Sprintf("pid %d has enabled peer access between its GPUs (2 link(s)) and holds a cudaMalloc allocation of 512 MiB", pid),
				"over 256 MiB back on", "CUDA_ERROR_INVALID_HANDLE", "left held", "nothing was touched", "--no-peer-access",
				"pieces of at most 256 MiB", "XLA_PYTHON_CLIENT_PREALLOCATE=false avoids it"},
			notWant: []string{"CUDA_ERROR_INVALID_VALUE", "shares GPU memory"}},
		{name: "a 1 GiB allocation without peer links",
			replies: status(`,"peer_access":0,"peer_toggle":true,"largest_device_alloc":1073741824,"ipc":{"exported":0,"imported":0}`)},
		{name: "peer links the shim turns off, and imported", replies: status(`,"peer_access":2,"peer_toggle":true,"ipc":{"exported":0,"imported":1}`),
			want: shareWhy, notWant: []string{"peer access"}},
		{name: "exported", replies: status(ipc(2, 0, `"ipc_mem":{"exported":1,"imported":0},"vmm":{"exported":1,"imported":0},`)),
			want:    append([]string{fmt.Sprintf("pid %d shares GPU memory", pid), "exported 2 (CUDA IPC: 1, VMM shareable handles: 1)"}, shareWhy...),
			notWant: []string{"imported", "peer access"}},
		{name: "imported", replies: status(ipc(0, 3, `"pool":{"exported":0,"imported":1},"pool_ptr":{"exported":0,"imported":2},`)),
			want:    append([]string{"imported 3 (memory pools: 1, memory pool pointers: 2)"}, shareWhy...),
			notWant: []string{"(exported", "peer access"}},
		{name: "exported and imported, no breakdown", replies: status(ipc(1, 1, "")),
			want: append([]string{"exported 1; imported 1;"}, shareWhy...)},
		{name: "peer links and imported",
			replies: status(`,"peer_access":2,"ipc":{"exported":0,"imported":1,"vmm":{"exported":0,"imported":1}}`),
			want:    append(append([]string{"; it also shares GPU memory", "imported 1 (VMM shareable handles: 1)"}, peerWhy...), shareWhy...)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			t.Setenv("PTXMIG_SOCKET_DIR", dir)
			if tt.replies != nil {
				shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), tt.replies)
			}
			err := RefuseUnrestorable(context.Background(), []int{pid})
			if tt.want == nil {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrRefused) {
				t.Fatalf("err = %v, want a refusal", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("refusal lacks %q:\n%v", w, err)
				}
			}
			for _, w := range tt.notWant {
				if strings.Contains(err.Error(), w) {
					t.Errorf("refusal has %q:\n%v", w, err)
				}
			}
		})
	}
}

// TestRefuseUnrestorablePeerMessage: the peer-access refusal reads as it did before the sharing
// check was added.
func TestRefuseUnrestorablePeerMessage(t *testing.T) {
	pid := os.Getpid()
	dir := t.TempDir()
	t.Setenv("PTXMIG_SOCKET_DIR", dir)
	shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)),
		map[string]string{"status": reply("status", fmt.Sprintf(`{"pid":%d,"proto":2,"peer_access":2}`, pid), 2)})
	want := fmt.Sprintf("pid %d has enabled peer access between its GPUs (2 link(s), reported by the ptxmig shim): "+
		"the NVIDIA driver checkpoints such a process but cannot restore it (cuCheckpointProcessRestore fails with "+
		"CUDA_ERROR_INVALID_VALUE, in place or onto other GPUs; measured with driver 580.159.04), so it would be lost; "+
		"nothing was touched. Start it with `ptxmig run --no-peer-access` (its GPUs then answer as a pair without a "+
		"peer path: frameworks such as JAX and PyTorch copy between them through host memory), or have the "+
		"application disable peer access first (cuCtxDisablePeerAccess / cudaDeviceDisablePeerAccess; NCCL: "+
		"NCCL_P2P_DISABLE=1)", pid)
	if err := RefuseUnrestorable(context.Background(), []int{pid}); err == nil || err.Error() != want {
		t.Fatalf("err = %v\nwant    %s", err, want)
	}
}

// TestRefuseUnrestorableFailsClosed: a process that has the shim mapped but whose status cannot be
// read (a garbled reply here; a 1.9 s reply to a 2 s bound on a DDP rank) is refused: it might
// share GPU memory, and a checkpoint the driver cannot restore loses it. Without the shim mapped the
// same answer lets the operation go ahead (TestRefuseUnrestorable, "garbled status").
func TestRefuseUnrestorableFailsClosed(t *testing.T) {
	pid := os.Getpid()
	// A file named like the shim, mapped into this process, is what /proc/PID/maps shows of a shim.
	mapFile(t, filepath.Join(t.TempDir(), "libptxmig.so"))
	if ok, err := shimctl.MapsHaveShim(pid); !ok || err != nil {
		t.Fatalf("the mapped stand-in is not seen as the shim: %v %v", ok, err)
	}
	dir := t.TempDir()
	t.Setenv("PTXMIG_SOCKET_DIR", dir)
	shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), map[string]string{"status": "{nope\n"})
	err := RefuseUnrestorable(context.Background(), []int{pid})
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "did not say whether it shares GPU memory") {
		t.Fatalf("err = %v, want a refusal", err)
	}
}

// TestUnchecked: processes without the shim get a warning where sharing is likely (several CUDA
// processes, or one on several GPUs), naming what cannot be checked and the way to have it
// checked; one process on one GPU gets none.
func TestUnchecked(t *testing.T) {
	a, b := os.Getpid(), os.Getppid() // neither maps the shim
	if w := Unchecked([]int{a}, false); w != nil {
		t.Errorf("one process on one GPU: %q, want no warning", w)
	}
	w := Unchecked([]int{a, b}, false)
	if len(w) != 1 || !strings.Contains(w[0], "share GPU memory") || !strings.Contains(w[0], "--nccl-sockets") ||
		!strings.Contains(w[0], fmt.Sprint(a)) {
		t.Errorf("two processes: %q", w)
	}
	w = Unchecked([]int{a}, true)
	if len(w) != 1 || !strings.Contains(w[0], "peer access") || !strings.Contains(w[0], "ptxmig run") {
		t.Errorf("one process on two GPUs: %q", w)
	}
}

// reply is one line of a fake shim's answers.
func reply(cmd, result string, proto int) string {
	return fmt.Sprintf(`{"ok":true,"proto":%d,"cmd":%q,"result":%s}`+"\n", proto, cmd, result)
}

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
