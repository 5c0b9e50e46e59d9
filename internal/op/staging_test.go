package op

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/ptxmig/ptxmig/internal/oplock"
	"github.com/ptxmig/ptxmig/internal/testreq"
)

// TestChooseStagingRefusesUnsafeRoot checks that a staging root another user could control is
// refused before CRIU writes process memory into it: a symlink (to anywhere) and a directory
// owned by another user.
func TestChooseStagingRefusesUnsafeRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		testreq.Skip(t, "root", "needs root to create a directory owned by another user")
	}
	dir := t.TempDir()
	link := filepath.Join(dir, "link")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	foreign := filepath.Join(dir, "foreign")
	if err := os.Mkdir(foreign, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(foreign, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	for _, root := range []string{link, foreign} {
		_, err := ChooseStaging(root, 0, 0)
		if !errors.Is(err, ErrRefused) || !errors.Is(err, oplock.ErrUnsafeDir) {
			t.Errorf("ChooseStaging(%s) = %v, want a refusal wrapping ErrUnsafeDir", root, err)
		}
	}
	good := filepath.Join(dir, "good")
	got, err := ChooseStaging(good, 0, 0)
	if err != nil || got != good {
		t.Fatalf("ChooseStaging(%s) = %q, %v", good, got, err)
	}
	if st, err := os.Lstat(good); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("staging root mode: %v, %v; want 0700", st.Mode(), err)
	}
	if _, err := ChooseStaging(good, 1<<62, 0); !errors.Is(err, ErrRefused) {
		t.Errorf("ChooseStaging with no room: %v, want ErrRefused", err)
	}
}

func TestCheckHostMemory(t *testing.T) {
	const gib = 1 << 30
	tests := []struct {
		gpu, avail uint64
		refused    bool
	}{
		{gpu: 8 * gib, avail: 100 * gib},
		{gpu: 99 * gib, avail: 100 * gib},
		{gpu: 105 * gib, avail: 100 * gib, refused: true}, // JAX's default preallocation on an H200
		{gpu: 100 * gib, avail: 100 * gib, refused: true}, // nothing left for the rest
		{gpu: 105 * gib, avail: 0},                        // unknown: the driver decides
		{gpu: 0, avail: gib / 2},
	}
	for _, tt := range tests {
		err := checkHostMemory(tt.gpu, tt.avail)
		if got := errors.Is(err, ErrRefused); got != tt.refused {
			t.Errorf("checkHostMemory(%d GiB, %d GiB) = %v; want refused %v", tt.gpu/gib, tt.avail/gib, err, tt.refused)
		}
	}
}
