package op

import (
	"path/filepath"
	"testing"
)

func TestCommand(t *testing.T) {
	tests := []struct {
		store string
		args  []string
		want  string
	}{
		{"", []string{"image", "gc"}, "ptxmig image gc"},
		{DefaultStoreDir, []string{"image", "rm", "job-1"}, "ptxmig image rm job-1"},
		{"/data/ptxmig", []string{"image", "rm", "job-1"}, "ptxmig --store /data/ptxmig image rm job-1"},
		{"/mnt/my store", []string{"restore", "it's"}, `ptxmig --store '/mnt/my store' restore 'it'\''s'`},
	}
	for _, tt := range tests {
		if got := Command(tt.store, tt.args...); got != tt.want {
			t.Errorf("Command(%q, %q) = %q, want %q", tt.store, tt.args, got, tt.want)
		}
	}
	// The default store, wherever its symlink leads, needs no --store.
	if target, err := filepath.EvalSymlinks(DefaultStoreDir); err == nil && target != DefaultStoreDir {
		if got := Command(target, "image", "gc"); got != "ptxmig image gc" {
			t.Errorf("Command(%q) = %q: the default store's target", target, got)
		}
	}
}
