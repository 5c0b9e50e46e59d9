package op

import (
	"context"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// PlanStep is one step of an operation's plan, as --dry-run prints it.
type PlanStep struct {
	Step   string `json:"step"`
	Action string `json:"action"`
}

// Kinds of process images (internal/imagedesc, which holds what an image records).
const (
	KindCUDA = imagedesc.KindCUDA
	KindCPU  = imagedesc.KindCPU
)

// TreeProc is one process of a checkpointed tree, as recorded in the image.
type TreeProc = imagedesc.TreeProc

// TreePIDs lists the pids of a tree; cudaOnly keeps the CUDA processes.
func TreePIDs(t []TreeProc, cudaOnly bool) []int { return imagedesc.TreePIDs(t, cudaOnly) }

// TreeOf converts /proc stats into a tree record; cuda marks the CUDA processes.
func TreeOf(stats []proc.Stat, cuda map[int]bool) []TreeProc { return imagedesc.TreeOf(stats, cuda) }

// ImageDir is a directory of an image's files on the host (a staged dump, a materialized image):
// what the staged data paths of checkpoint and restore read back. No symbolic link is followed.
type ImageDir string

// Has reports whether the directory holds name as a regular file.
func (d ImageDir) Has(name string) bool {
	fi, err := os.Lstat(filepath.Join(string(d), name))
	return err == nil && fi.Mode().IsRegular()
}

// WriteFile copies the file name into w.
func (d ImageDir) WriteFile(_ context.Context, name string, w io.Writer) (int64, error) {
	f, err := os.OpenFile(filepath.Join(string(d), name), os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return io.Copy(w, f)
}
