package store

import (
	"bytes"
	"context"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
)

// testChunk is small so tests exercise many chunks without much data.
const testChunk = 64 << 10

func openTestStore(t testing.TB) *Store {
	t.Helper()
	s, err := Open(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// treeSpec describes a random tree.
type treeSpec struct {
	seed     uint64
	files    int
	maxSize  int
	sparse   bool
	symlinks bool
}

// makeTree writes a random directory tree under dir: nested directories with assorted modes,
// empty files, files with random, zero, repetitive and float-like content, sparse files and
// symlinks (including dangling and absolute ones, which must be stored, not followed).
func makeTree(t testing.TB, dir string, sp treeSpec) {
	t.Helper()
	r := rand.New(rand.NewPCG(sp.seed, 42))
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(dir, 0o755))
	dirs := []string{"."}
	for i := range 1 + sp.files/4 {
		parent := dirs[r.IntN(len(dirs))]
		d := filepath.Join(parent, "d"+string(rune('a'+i%26))+string(rune('0'+i/26%10)))
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err == nil {
			dirs = append(dirs, d)
		}
	}
	modes := []os.FileMode{0o600, 0o644, 0o755, 0o400, 0o640}
	for i := range sp.files {
		p := filepath.Join(dir, dirs[r.IntN(len(dirs))], "f"+strings.Repeat("x", i%3)+string(rune('a'+i%26))+string(rune('0'+i/26%10)))
		size := r.IntN(sp.maxSize + 1)
		switch i % 7 {
		case 0:
			size = 0
		case 1:
			size = testChunk * (1 + r.IntN(3)) // exact chunk multiples
		}
		data := make([]byte, size)
		switch r.IntN(4) {
		case 0: // random
			for j := range data {
				data[j] = byte(r.Uint32())
			}
		case 1: // repetitive text
			for j := range data {
				data[j] = "ptxmig checkpoint "[j%18]
			}
		case 2: // float-like, or random
			for j := 0; j+4 <= len(data); j += 4 {
				v := r.NormFloat64() * 0.02
				putF32(data[j:], float32(v))
			}
		case 3: // mostly zero with a random block
			if size > 0 {
				k := r.IntN(size)
				data[k] = byte(r.Uint32()) | 1
			}
		}
		must(os.WriteFile(p, data, 0o600))
		if sp.sparse && i%5 == 2 {
			// A sparse file: data, a hole of several chunks, data, trailing hole.
			f, err := os.OpenFile(p, os.O_WRONLY, 0)
			must(err)
			_, err = f.WriteAt([]byte("tail"), int64(size)+5*testChunk+123)
			must(err)
			must(f.Truncate(int64(size) + 9*testChunk))
			must(f.Close())
		}
		must(os.Chmod(p, modes[r.IntN(len(modes))]))
	}
	if sp.symlinks {
		must(os.Symlink("../../etc/passwd", filepath.Join(dir, "escape-link")))
		must(os.Symlink("/etc/shadow", filepath.Join(dir, "abs-link")))
		must(os.Symlink("no-such-target", filepath.Join(dir, dirs[len(dirs)-1], "dangling")))
		must(os.Symlink(dirs[len(dirs)-1], filepath.Join(dir, "dir-link")))
	}
	for _, d := range dirs[1:] {
		if r.IntN(3) == 0 {
			must(os.Chmod(filepath.Join(dir, d), 0o555)) // read-only directory
		}
	}
}

func putF32(b []byte, f float32) {
	u := mathFloat32bits(f)
	b[0], b[1], b[2], b[3] = byte(u), byte(u>>8), byte(u>>16), byte(u>>24)
}

// entry is one file of a tree as compared by sameTree.
type entry struct {
	mode   fs.FileMode
	data   []byte
	target string
	blocks int64
}

func readTree(t testing.TB, dir string) map[string]entry {
	t.Helper()
	out := map[string]entry{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		e := entry{mode: fi.Mode()}
		switch {
		case fi.Mode().IsRegular():
			if e.data, err = os.ReadFile(p); err != nil {
				return err
			}
			e.blocks = fi.Sys().(*syscall.Stat_t).Blocks
		case fi.Mode()&fs.ModeSymlink != 0:
			if e.target, err = os.Readlink(p); err != nil {
				return err
			}
			e.mode = fs.ModeSymlink
		}
		out[rel] = e
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// sameTree fails unless b has exactly a's entries, modes and bytes, and sparse files in a
// occupy no more blocks in b.
func sameTree(t testing.TB, a, b string) {
	t.Helper()
	ta, tb := readTree(t, a), readTree(t, b)
	var names []string
	for n := range ta {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		ea, eb := ta[n], tb[n]
		if _, ok := tb[n]; !ok {
			t.Errorf("%s missing after round trip", n)
			continue
		}
		if ea.mode != eb.mode {
			t.Errorf("%s: mode %v, want %v", n, eb.mode, ea.mode)
		}
		if ea.target != eb.target {
			t.Errorf("%s: link target %q, want %q", n, eb.target, ea.target)
		}
		if !bytes.Equal(ea.data, eb.data) {
			t.Errorf("%s: content differs (%d vs %d bytes)", n, len(eb.data), len(ea.data))
		}
		if eb.blocks > ea.blocks+8 { // +4 KiB slack for filesystem rounding
			t.Errorf("%s: %d blocks after round trip, source has %d: sparseness lost", n, eb.blocks, ea.blocks)
		}
	}
	for n := range tb {
		if _, ok := ta[n]; !ok {
			t.Errorf("%s appeared after round trip", n)
		}
	}
}

// chmodTree makes a tree removable by t.TempDir's cleanup (read-only dirs).
func chmodTree(dir string) {
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			os.Chmod(p, 0o755)
		}
		return nil
	})
}

// putRandom stores a directory holding one file "f" of n random bytes (seed) as the image o.Name
// and returns the directory.
func putRandom(t testing.TB, s *Store, n int, seed uint64, o PutOptions) string {
	t.Helper()
	src := t.TempDir()
	writeRandom(t, filepath.Join(src, "f"), n, seed)
	if _, _, err := s.Put(context.Background(), src, o); err != nil {
		t.Fatal(err)
	}
	return src
}
