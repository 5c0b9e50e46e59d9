//go:build gpu

package gputest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/driverstep"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/migrate"
	"github.com/ptxmig/ptxmig/restore"
)

// TestOwnedMemory: counter under `ptxmig run --owned-memory` (its cudaMalloc memory served from
// the shim's VMM mappings), with PTXMIG_OWNED_MIB MiB (default 256) it advances every step and a
// frozen GiB it never writes again. Three checkpoints: --leave-running (every chunk copied, then
// loaded back from the image being written), --leave-running again (the frozen GiB is unchanged:
// its chunks are referenced, not copied), and a final one that ends the process; the restore
// loads the memory back and the run ends with the checksums of an uninterrupted run. The copy
// and load figures go to $PTXMIG_OUT/gputest/owned.md.
func TestOwnedMemory(t *testing.T) {
	need(t, 1)
	mib := 256
	if v, err := strconv.Atoi(os.Getenv("PTXMIG_OWNED_MIB")); err == nil && v > 0 {
		mib = v
	}
	args := []string{"--mib", strconv.Itoa(mib), "--frozen-mib", "1024", "--steps", "120", "--interval-ms", "100"}
	ref := referenceAsync(t, "counter", args...)
	p := startShimmedCache(t, []string{"--preempt", "auto", "--owned-memory"}, filepath.Join(out, "gputest", "ptxcache"), filepath.Join(workloads, "counter"), args...)
	waitLine(t, p.log, "step 5 ", 3*time.Minute)
	owned := func(res []*shimstep.PreemptReport) *shimstep.OwnedMemory {
		t.Helper()
		for _, r := range res {
			if r.PID == p.pid && r.Owned != nil {
				return r.Owned
			}
		}
		t.Fatalf("no owned-memory report for pid %d: %+v", p.pid, res)
		return nil
	}
	ckpt := func(name string, extra ...string) *checkpoint.Result {
		t.Helper()
		so, se, code := ptxmig(t, append(append([]string{"--json", "checkpoint", "--name", name}, extra...), strconv.Itoa(p.pid))...)
		if code != 0 {
			t.Fatalf("checkpoint %s: exit %d: %s", name, code, se)
		}
		var ck checkpoint.Result
		if err := json.Unmarshal([]byte(so), &ck); err != nil {
			t.Fatalf("checkpoint JSON: %v", err)
		}
		return &ck
	}
	var rows []string
	row := func(what string, ck *checkpoint.Result, m *shimstep.OwnedMemory) {
		s := m.Save
		text := fmt.Sprintf("| %s | %d MiB owned in %d regions | copied %d MiB in %s (%.1f GB/s, hash %s), skipped %d MiB | lock %s, driver checkpoint %s, dump %s, store %s, total %s |",
			what, s.OwnedBytes>>20, s.Regions, s.CopiedBytes>>20, s.Copy.Round(time.Millisecond), s.Throughput()/1e9, s.Hash.Round(time.Microsecond),
			s.SkippedBytes>>20, ck.Timings.Of(driverstep.StepLock).Round(time.Millisecond), ck.Timings.Of(driverstep.StepCheckpoint).Round(time.Millisecond),
			ck.Timings.Of(checkpoint.StepDump).Round(time.Millisecond), ck.Timings.Of(checkpoint.StepStore).Round(time.Millisecond), ck.Total.Round(time.Millisecond))
		t.Log(text)
		rows = append(rows, text)
	}

	ck1 := ckpt("owned-1", "--leave-running")
	m1 := owned(ck1.Preemption)
	if m1.Save == nil || m1.Save.CopiedBytes != m1.Save.OwnedBytes || m1.Save.OwnedBytes < int64(mib+1024)<<20 || m1.Load == nil || m1.Released {
		t.Fatalf("first checkpoint: %+v save %+v load %+v; want everything copied and loaded back", m1, m1.Save, m1.Load)
	}
	row("1st, --leave-running", ck1, m1)
	waitLine(t, p.log, "step 20 ", 3*time.Minute)
	ck2 := ckpt("owned-2", "--leave-running")
	m2 := owned(ck2.Preemption)
	if m2.Save == nil || m2.Save.SkippedBytes < 1024<<20 || m2.Save.Prev != "owned-1" {
		t.Fatalf("second checkpoint: save %+v; want the frozen GiB referenced from owned-1", m2.Save)
	}
	row("2nd, --leave-running", ck2, m2)
	waitLine(t, p.log, "step 30 ", 3*time.Minute)
	ck3 := ckpt("owned-3")
	m3 := owned(ck3.Preemption)
	row("3rd, process ends", ck3, m3)
	<-p.done
	so, se, code := ptxmig(t, "--json", "restore", "owned-3")
	if code != 0 {
		t.Fatalf("restore: exit %d: %s", code, se)
	}
	var rs restore.Result
	if err := json.Unmarshal([]byte(so), &rs); err != nil {
		t.Fatalf("restore JSON: %v", err)
	}
	lm := owned(rs.Preemption)
	if lm.Load == nil || lm.Load.Bytes != m3.Save.OwnedBytes {
		t.Fatalf("restore: owned memory %+v, want %d bytes loaded", lm.Load, m3.Save.OwnedBytes)
	}
	lrow := fmt.Sprintf("| restore | loaded %d MiB in %s (%.1f GB/s, re-map %s) | | CRIU %s, driver restore %s, unlock %s, load %s, total %s |",
		lm.Load.Bytes>>20, lm.Load.Copy.Round(time.Millisecond), float64(lm.Load.Bytes)/lm.Load.Copy.Seconds()/1e9, lm.Load.Remap.Round(time.Microsecond),
		rs.Timings.Of(restore.StepCRIURestore).Round(time.Millisecond), rs.Timings.Of(driverstep.StepDriverRestore).Round(time.Millisecond),
		rs.Timings.Of(driverstep.StepUnlock).Round(time.Millisecond), rs.Timings.Of(shimstep.StepLoadMemory).Round(time.Millisecond), rs.Total.Round(time.Millisecond))
	t.Log(lrow)
	rows = append(rows, lrow)
	waitExit(t, rs.PID, 5*time.Minute)
	sameResults(t, results(p.log), <-ref)
	dir := filepath.Join(out, "gputest")
	_ = os.MkdirAll(dir, 0o755)
	text := "| checkpoint | owned memory | copy | phases |\n|---|---|---|---|\n" + strings.Join(rows, "\n") + "\n"
	if err := os.WriteFile(filepath.Join(dir, "owned.md"), []byte(text), 0o644); err != nil {
		t.Error(err)
	}
}

// TestMigrateOwnedMemory: counter under `ptxmig run --owned-memory` with PTXMIG_OWNED_MIB MiB
// (default 256) it advances and a frozen GiB, migrated four times: to the other GPU and back on a
// host with two, `migrate --rehearse` (onto its own GPU) on a host with one. Every move stashes all
// the owned memory in the process, copies it device to device into memory ptxmig keeps on the
// target, and puts it back from there; the run ends with the checksums of an
// uninterrupted run. The downtimes go to $PTXMIG_OUT/gputest/owned-migrate.md.
func TestMigrateOwnedMemory(t *testing.T) {
	devs := need(t, 1)
	mib := 256
	if v, err := strconv.Atoi(os.Getenv("PTXMIG_OWNED_MIB")); err == nil && v > 0 {
		mib = v
	}
	args := []string{"--mib", strconv.Itoa(mib), "--frozen-mib", "1024", "--steps", "100", "--interval-ms", "100"}
	ref := referenceAsync(t, "counter", args...)
	p := startShimmedCache(t, []string{"--preempt", "auto", "--owned-memory"}, filepath.Join(out, "gputest", "ptxcache"), filepath.Join(workloads, "counter"), args...)
	waitLine(t, p.log, "step 5 ", 3*time.Minute)
	rows := []string{"| move | owned memory | stash (copy) | device copy to the target | lock, driver checkpoint, restore, unlock | unstash (re-create, copy; from) | downtime |", "|---|---|---|---|---|---|---|"}
	for i := range 4 {
		move := []string{"--rehearse"}
		if len(devs) > 1 {
			move = []string{"--gpu", strconv.Itoa((i + 1) % 2)}
		}
		so, se, code := ptxmig(t, append(append([]string{"--json", "migrate"}, move...), strconv.Itoa(p.pid))...)
		if code != 0 {
			t.Fatalf("migrate %v: exit %d: %s", move, code, se)
		}
		var res migrate.Result
		if err := json.Unmarshal([]byte(so), &res); err != nil {
			t.Fatalf("migrate JSON: %v", err)
		}
		var m *shimstep.OwnedMemory
		for _, r := range res.Preemption {
			if r.PID == p.pid {
				m = r.Owned
			}
		}
		if m == nil || m.Stash == nil || m.Unstash == nil || m.Stash.Bytes < uint64(mib+1024)<<20 || m.Unstash.Bytes != m.Stash.Bytes || m.Released {
			t.Fatalf("migrate %v: owned memory %+v; want all of it stashed and put back", move, m)
		}
		// The default moves the memory device to device too: kept on the target, filled in the
		// stop, put back from there.
		if m.Target == nil || m.Stash.Target == nil || !m.Stash.Target.Filled || m.Unstash.From != "target" {
			t.Fatalf("migrate %v: no device-to-device copy: kept %+v (%s), stop %+v, unstash from %q (%s)", move, m.Target, m.TargetNote,
				m.Stash.Target, m.Unstash.From, m.Unstash.TargetError)
		}
		us := func(x int64) time.Duration { return time.Duration(x) * time.Microsecond }
		dc := fmt.Sprintf("%s (map %s, %.0f GB/s)", us(m.Stash.Target.CopyUS).Round(100*time.Microsecond), us(m.Stash.Target.MapUS).Round(100*time.Microsecond),
			float64(m.Stash.Target.Bytes)/max(us(m.Stash.Target.CopyUS).Seconds(), 1e-9)/1e9)
		row := fmt.Sprintf("| %s | %d MiB in %d regions | %s (%s, %.1f GB/s, pinned %v) | %s | %s, %s, %s, %s | %s (%s, %s; %s) | %s |", strings.Join(move, " "),
			m.Stash.Bytes>>20, m.Stash.Regions, res.Stash.Round(time.Millisecond), us(m.Stash.CopyUS).Round(time.Millisecond),
			float64(m.Stash.Bytes)/max(us(m.Stash.CopyUS).Seconds(), 1e-9)/1e9, m.Stash.Pinned, dc,
			res.Lock.Round(time.Millisecond), res.Checkpoint.Round(time.Millisecond), res.Restore.Round(time.Millisecond), res.Unlock.Round(time.Millisecond),
			res.Unstash.Round(time.Millisecond), us(m.Unstash.RemapUS).Round(time.Millisecond), us(m.Unstash.CopyUS).Round(time.Millisecond), m.Unstash.From,
			res.Downtime.Round(time.Millisecond))
		t.Log(row)
		rows = append(rows, row)
		waitLine(t, p.log, fmt.Sprintf("step %d ", 20+15*i), 3*time.Minute)
	}
	<-p.done
	sameResults(t, results(p.log), <-ref)
	dir := filepath.Join(out, "gputest")
	_ = os.MkdirAll(dir, 0o755)
	if err := os.WriteFile(filepath.Join(dir, "owned-migrate.md"), []byte(strings.Join(rows, "\n")+"\n"), 0o644); err != nil {
		t.Error(err)
	}
}
