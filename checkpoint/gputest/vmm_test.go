//go:build gpu

package gputest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/restore"
)

// TestVMMReleaseAcrossCRIU is step 1 of "device memory at link speed" (../shared/probes/vmm.c,
// measured without CRIU): the vmmhold workload backs N MiB with the VMM API, and on SIGUSR1 copies
// them to ordinary host memory through two small pinned staging buffers, unmaps and releases the
// physical memory (keeping the address reservation) and waits. ptxmig then checkpoints it (the
// driver moves only the 64 MiB cuMemAlloc region and the context; CRIU dumps the host copy) and
// the process ends; after `ptxmig restore`, SIGUSR2 makes it map new physical memory at the same
// address and copy the data back. Its final checksum must equal an uninterrupted run's. Sizes:
// 1 GiB, and PTXMIG_VMM_MIB (e.g. 8192) when set. The timings go to the log and to
// $PTXMIG_OUT/gputest/vmm.md; bench-cr.sh times the same sizes held as cuMemAlloc memory, which
// the driver copies itself.
func TestVMMReleaseAcrossCRIU(t *testing.T) {
	need(t, 1)
	sizes := []int{1024}
	if v, err := strconv.Atoi(os.Getenv("PTXMIG_VMM_MIB")); err == nil && v > 0 {
		sizes = append(sizes, v)
	}
	var rows []string
	for _, mib := range sizes {
		t.Run(fmt.Sprintf("%dMiB", mib), func(t *testing.T) {
			args := []string{"--mib", strconv.Itoa(mib), "--steps", "30", "--interval-ms", "100"}
			p := start(t, "vmmhold", args...)
			waitLine(t, p.log, "step 5 ", 3*time.Minute)
			if err := syscall.Kill(p.pid, syscall.SIGUSR1); err != nil {
				t.Fatal(err)
			}
			rel := waitLine(t, p.log, "released ", 3*time.Minute)
			name := fmt.Sprintf("vmm-%d", mib)
			so, se, code := ptxmig(t, "--json", "checkpoint", "--name", name, strconv.Itoa(p.pid))
			if code != 0 {
				t.Fatalf("checkpoint of the released process: exit %d: %s", code, se)
			}
			var ck checkpoint.Result
			if err := json.Unmarshal([]byte(so), &ck); err != nil {
				t.Fatalf("checkpoint JSON: %v", err)
			}
			<-p.done
			so, se, code = ptxmig(t, "--json", "restore", name)
			if code != 0 {
				t.Fatalf("restore: exit %d: %s", code, se)
			}
			var rs restore.Result
			if err := json.Unmarshal([]byte(so), &rs); err != nil {
				t.Fatalf("restore JSON: %v", err)
			}
			if err := syscall.Kill(rs.PID, syscall.SIGUSR2); err != nil {
				t.Fatal(err)
			}
			acq := waitLine(t, p.log, "reacquire", 3*time.Minute)
			if strings.Contains(acq, "FAILED") {
				t.Fatalf("after the restore: %s", acq)
			}
			waitExit(t, rs.PID, 3*time.Minute)
			ref := start(t, "vmmhold", "--mib", strconv.Itoa(mib), "--steps", "30", "--interval-ms", "0")
			<-ref.done
			got, want := waitLine(t, p.log, "final ", time.Second), waitLine(t, ref.log, "final ", time.Second)
			if got != want {
				t.Fatalf("restored run ended with %q, an uninterrupted run with %q", got, want)
			}
			row := fmt.Sprintf("| %d MiB | %s | driver checkpoint %s, CRIU dump %s, total %s; image %d MiB logical | CRIU %s, driver restore %s, total %s | %s |",
				mib, strings.TrimPrefix(rel, "released "), ck.Timings.Of(driverstep.StepCheckpoint).Round(time.Millisecond),
				ck.Timings.Of(checkpoint.StepDump).Round(time.Millisecond), ck.Total.Round(time.Millisecond), ck.Sizes.Logical>>20,
				rs.Timings.Of(restore.StepCRIURestore).Round(time.Millisecond), rs.Timings.Of(driverstep.StepDriverRestore).Round(time.Millisecond),
				rs.Total.Round(time.Millisecond), strings.TrimPrefix(acq, "reacquired "))
			t.Log(row)
			rows = append(rows, row)
		})
	}
	if len(rows) > 0 {
		text := "| size | release (ms, GB/s) | checkpoint | restore | reacquire (ms, GB/s) |\n|---|---|---|---|---|\n" + strings.Join(rows, "\n") + "\n"
		dir := filepath.Join(out, "gputest")
		_ = os.MkdirAll(dir, 0o755)
		if err := os.WriteFile(filepath.Join(dir, "vmm.md"), []byte(text), 0o644); err != nil {
			t.Error(err)
		}
	}
}
