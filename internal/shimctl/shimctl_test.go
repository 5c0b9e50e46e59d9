package shimctl

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
)

// fakeShim serves canned replies, one per request line, on a Unix socket in a temp dir.
func fakeShim(t *testing.T, replies map[string]string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "1234.sock")
	shimctltest.Serve(t, path, replies)
	return path
}

func TestClient(t *testing.T) {
	tests := []struct {
		name, cmd, reply string
		wantErr          error
		check            func(*testing.T, *Client)
	}{
		{name: "status", cmd: "status",
			reply: `{"ok":true,"proto":1,"cmd":"status","result":{"pid":42,"shim":"ptxmig-shim 1","devices":[{"ordinal":0,"name":"H200","total_bytes":1}],"modules":[{"id":1,"source":"cuLibraryLoadData","format":"fatbin","bytes":10,"ptx":1,"elf":2,"archs":"sm_90,compute_90"}]}}` + "\n",
			check: func(t *testing.T, c *Client) {
				s, err := c.Status(context.Background())
				if err != nil || s.PID != 42 || len(s.Modules) != 1 || s.Modules[0].ELF != 2 || s.Devices[0].Name != "H200" ||
					s.IPC != nil || s.PeerAccess != 0 { // a shim before "peer_access" and "ipc"
					t.Fatalf("status = %+v, %v", s, err)
				}
			}},
		{name: "status with sharing", cmd: "status",
			reply: `{"ok":true,"proto":2,"cmd":"status","result":{"pid":42,"peer_access":1,"ipc":{"exported":3,"imported":1,` +
				`"ipc_mem":{"exported":1,"imported":0},"vmm":{"exported":1,"imported":1},"pool":{"exported":0,"imported":0},` +
				`"pool_ptr":{"exported":1,"imported":0},"export_calls":7,"import_calls":2,"untracked":{"exported":0,"imported":0}}}}` + "\n",
			check: func(t *testing.T, c *Client) {
				s, err := c.Status(context.Background())
				want := IPC{Exported: 3, Imported: 1, IPCMem: ShareCount{Exported: 1}, VMM: ShareCount{Exported: 1, Imported: 1},
					PoolPointer: ShareCount{Exported: 1}, ExportCalls: 7, ImportCalls: 2}
				if err != nil || s.PeerAccess != 1 || s.IPC == nil || *s.IPC != want {
					t.Fatalf("status = %+v (ipc %+v), %v", s, s.IPC, err)
				}
			}},
		{name: "kernels", cmd: "kernels",
			reply: `{"ok":true,"proto":1,"cmd":"kernels","result":{"kernels":[{"name":"k","handle":"0x1","module":1,"launches":5,"shapes":[{"grid":[1,2,3],"block":[4,5,6],"launches":5}],"timed":2,"time_us":{"p50":1.5,"p99":2,"mean":1.7,"max":2}}],"graphs":[],"total_launches":5}}` + "\n",
			check: func(t *testing.T, c *Client) {
				k, err := c.Kernels(context.Background())
				if err != nil || len(k.Kernels) != 1 || *k.Kernels[0].Name != "k" || k.Kernels[0].Shapes[0].Block != [3]uint32{4, 5, 6} || k.Kernels[0].Time.P50 != 1.5 {
					t.Fatalf("kernels = %+v, %v", k, err)
				}
			}},
		{name: "kernels with self time", cmd: "kernels",
			reply: `{"ok":true,"proto":1,"cmd":"kernels","result":{"kernels":[],"graphs":[],"total_launches":9,"self_time":{"enabled":true,"launches":9,"ns":1800,"clock_ns":25}}}` + "\n",
			check: func(t *testing.T, c *Client) {
				k, err := c.Kernels(context.Background())
				if err != nil || k.SelfTime == nil || !k.SelfTime.Enabled || k.SelfTime.Launches != 9 || k.SelfTime.Ns != 1800 || k.SelfTime.ClockNs != 25 {
					t.Fatalf("kernels = %+v, %v", k, err)
				}
			}},
		{name: "shim error", cmd: "status", reply: `{"ok":false,"proto":1,"error":"boom"}` + "\n", wantErr: ErrShim},
		{name: "not json", cmd: "status", reply: "hello\n", wantErr: ErrProtocol},
		{name: "no ok", cmd: "status", reply: `{"proto":1}` + "\n", wantErr: ErrProtocol},
		{name: "wrong proto", cmd: "status", reply: `{"ok":true,"proto":7,"cmd":"status","result":{"pid":1}}` + "\n", wantErr: ErrProtocol},
		{name: "wrong cmd", cmd: "status", reply: `{"ok":true,"proto":1,"cmd":"kernels","result":{"pid":1}}` + "\n", wantErr: ErrProtocol},
		{name: "bad pid", cmd: "status", reply: `{"ok":true,"proto":1,"cmd":"status","result":{"pid":-3}}` + "\n", wantErr: ErrProtocol},
		{name: "array result", cmd: "status", reply: `{"ok":true,"proto":1,"cmd":"status","result":[1]}` + "\n", wantErr: ErrProtocol},
		{name: "truncated", cmd: "status", reply: `{"ok":true,"proto":1,"cmd":"st`, wantErr: ErrProtocol},
		{name: "bad timing", cmd: "kernels", reply: `{"ok":true,"proto":1,"cmd":"kernels","result":{"kernels":[{"name":"k","timed":1,"time_us":{"p50":5,"p99":1}}]}}` + "\n", wantErr: ErrProtocol},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := fakeShim(t, map[string]string{tt.cmd: tt.reply})
			c, err := Dial(context.Background(), path)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if tt.check != nil {
				tt.check(t, c)
				return
			}
			var gotErr error
			if tt.cmd == "status" {
				_, gotErr = c.Status(context.Background())
			} else {
				_, gotErr = c.Kernels(context.Background())
			}
			if !errors.Is(gotErr, tt.wantErr) {
				t.Fatalf("error = %v, want %v", gotErr, tt.wantErr)
			}
		})
	}
}

func TestDumpModulesValidates(t *testing.T) {
	path := fakeShim(t, map[string]string{"dump-modules": `{"ok":true,"proto":1,"cmd":"dump-modules","result":{"dir":"/elsewhere","index":"index.json"}}` + "\n"})
	c, err := Dial(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.DumpModules(context.Background(), "relative"); err == nil {
		t.Fatal("relative dir accepted")
	}
	if _, err := c.DumpModules(context.Background(), "/tmp/x"); !errors.Is(err, ErrProtocol) {
		t.Fatalf("dump into another dir: %v", err)
	}
}

func TestDialPIDChecksPeer(t *testing.T) {
	dir := t.TempDir()
	reply := `{"ok":true,"proto":1,"cmd":"status","result":{"pid":1}}` + "\n"
	serve := func(pid int) {
		t.Helper()
		shimctltest.Serve(t, SocketPath(dir, pid), map[string]string{"status": reply})
	}
	// A socket named after pid 1 but served by this test process: an impostor.
	serve(1)
	if _, err := DialPID(context.Background(), dir, 1); !errors.Is(err, ErrPeer) {
		t.Fatalf("dial a socket served by another process: %v, want ErrPeer", err)
	}
	// The socket named after this process is served by it.
	serve(os.Getpid())
	c, err := DialPID(context.Background(), dir, os.Getpid())
	if err != nil {
		t.Fatalf("dial own socket: %v", err)
	}
	c.Close()
}

func TestDialMissing(t *testing.T) {
	_, err := DialPID(context.Background(), t.TempDir(), 99999)
	if !errors.Is(err, ErrNoShim) {
		t.Fatalf("err = %v, want ErrNoShim", err)
	}
}

// TestIsShimLib pins the one shim rule: a base name matching libptxmig*.so*.
func TestIsShimLib(t *testing.T) {
	tests := []struct {
		path string
		want bool
	}{
		{"/usr/local/lib/libptxmig.so", true},
		{"/usr/lib/libptxmig.so.1", true},
		{"/usr/lib/x86_64-linux-gnu/libptxmig.so.1.2.3", true},
		{"/opt/ptxmig/libptxmig-san.so", true},
		{"/opt/my dir/libptxmig.so", true},
		{"/tmp/libptxmig.so (deleted)", true},
		{"libptxmig.so", true},
		{"/tmp/libptxmig.so.bak", true}, // matches the pattern: any libptxmig*.so* counts
		{"/usr/lib/libptxmig.a", false},
		{"/home/libptxmig-notes.txt", false},
		{"/x/notlibptxmig.so", false},
		{"/usr/lib/libptxmig.so/libc.so.6", false}, // only the base name counts
		{"/usr/lib/libcuda.so.1", false},
		{"[stack]", false},
		{"", false},
	}
	for _, tt := range tests {
		if got := IsShimLib(tt.path); got != tt.want {
			t.Errorf("IsShimLib(%q) = %v, want %v", tt.path, got, tt.want)
		}
	}
}

func TestMapsListingHasShim(t *testing.T) {
	tests := []struct {
		maps string
		want bool
	}{
		{"7f00-7f01 r-xp 00000000 08:01 123 /usr/local/lib/libptxmig.so\n", true},
		{"7f00-7f01 r-xp 00000000 08:01 123     /opt/my dir/libptxmig-san.so\n", true},
		{"7f00-7f01 r--p 00000000 08:01 9 /usr/lib/libc.so.6\n7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libptxmig.so.1 (deleted)\n", true},
		{"7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libcuda.so.1\n7f00-7f01 rw-p 00000000 00:00 0\n", false},
		{"7f00-7f01 r-xp 00000000 08:01 123 /home/libptxmig-notes.txt\n", false},
		{"libptxmig.so\n", false}, // not a maps line
		{"", false},
	}
	for _, tt := range tests {
		if got, err := MapsListingHasShim(strings.NewReader(tt.maps)); got != tt.want || err != nil {
			t.Errorf("MapsListingHasShim(%q) = %v, %v, want %v", tt.maps, got, err, tt.want)
		}
	}
	// This test process does not map the shim; a process that does not exist is an error.
	if ok, err := MapsHaveShim(os.Getpid()); ok || err != nil {
		t.Errorf("MapsHaveShim(self) = %v, %v", ok, err)
	}
	if _, err := MapsHaveShim(-1); err == nil {
		t.Error("MapsHaveShim(-1) succeeded")
	}
}

func TestDetect(t *testing.T) {
	dir := t.TempDir()
	// This test process has no socket and does not map the shim.
	if _, ok := DetectIn(dir, os.Getpid()); ok {
		t.Fatal("detected a shim in the test process")
	}
	// A socket alone is not enough: the process must map libptxmig.so.
	l, err := net.Listen("unix", SocketPath(dir, os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, ok := DetectIn(dir, os.Getpid()); ok {
		t.Fatal("detected a shim from the socket alone")
	}
	if _, ok := Detect(-1); ok {
		t.Fatal("negative pid detected")
	}
}
