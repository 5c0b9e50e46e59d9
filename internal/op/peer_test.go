package op

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/shimctl/shimctltest"
)

// TestRefusePeerAccess: a process whose shim reports peer links is refused (a refusal: exit 3,
// nothing touched); no shim, a shim reporting none, or a shim that does not answer lets the
// operation go ahead.
func TestRefusePeerAccess(t *testing.T) {
	pid := os.Getpid()
	status := func(links int) string {
		return reply("status", fmt.Sprintf(`{"pid":%d,"proto":2,"peer_access":%d}`, pid, links), 2)
	}
	tests := []struct {
		name    string
		replies map[string]string // nil: no socket at all
		refused bool
	}{
		{name: "no shim"},
		{name: "no peer links", replies: map[string]string{"status": status(0)}},
		{name: "an older shim without the field", replies: map[string]string{"status": reply("status", fmt.Sprintf(`{"pid":%d,"proto":2}`, pid), 2)}},
		{name: "garbled status", replies: map[string]string{"status": "{nope\n"}},
		{name: "two peer links", replies: map[string]string{"status": status(2)}, refused: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			t.Setenv("PTXMIG_SOCKET_DIR", dir)
			if tt.replies != nil {
				shimctltest.Serve(t, filepath.Join(dir, fmt.Sprintf("%d.sock", pid)), tt.replies)
			}
			err := RefusePeerAccess(context.Background(), []int{pid})
			if !tt.refused {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "peer access") || !strings.Contains(err.Error(), "2 link(s)") {
				t.Fatalf("err = %v, want a refusal naming the 2 peer links", err)
			}
		})
	}
}
