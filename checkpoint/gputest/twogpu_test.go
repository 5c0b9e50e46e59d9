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
	procfs "github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/shimstep"
	"github.com/ptxmig/ptxmig/migrate"
	"github.com/ptxmig/ptxmig/restore"
)

// Runs that only a host with two GPUs can make: a process in the middle of a long kernel migrated
// to the other GPU, and one process that uses both GPUs moved with the GPUs swapped.

// TestMigrateMidKernel: longgrid in the middle of a ~40 s kernel under `ptxmig run --preempt
// always` is migrated to GPU 1. The shim stops the kernel between blocks (the driver lock would
// otherwise wait for it), the driver moves the process, and the kernel's remainder is relaunched
// on GPU 1. Its checksums equal an uninterrupted run's, which runs on GPU 0 meanwhile (GPU 0 is
// free once the process has left it).
func TestMigrateMidKernel(t *testing.T) {
	need(t, 2)
	p := startShimmed(t, "always", "longgrid", "--seconds", "40", "--block-ms", "0.25", "--device", "0")
	fixed := longgridParams(t, p)
	waitStarted(t, p, 1, 2*time.Minute)
	time.Sleep(3 * time.Second)
	t0 := time.Now()
	so, se, code := ptxmig(t, "--json", "migrate", "--gpu", "1", strconv.Itoa(p.pid))
	wall := time.Since(t0)
	if code != 0 {
		t.Fatalf("migrate mid-kernel: exit %d after %s: %s", code, wall, se)
	}
	var mr migrate.Result
	if err := json.Unmarshal([]byte(so), &mr); err != nil {
		t.Fatalf("migrate result: %v\n%s", err, so)
	}
	if len(mr.Preemption) != 1 || mr.Preemption[0].Quiesce == nil || len(mr.Preemption[0].Quiesce.Preempted) == 0 {
		t.Fatalf("the migration preempted nothing: %+v", mr.Preemption)
	}
	pr := mr.Preemption[0]
	if pr.Resume == nil || pr.Resume.Relaunched < 1 || len(pr.Resume.Errors) > 0 {
		t.Fatalf("the preempted kernel was not relaunched on the target: %+v", pr.Resume)
	}
	logPairs(t, "migrate --gpu 1 mid-kernel", mr.Pairs)
	if g := gpuOf(t, p.pid); g != 1 {
		t.Fatalf("after migrate pid %d is on GPU %d, want 1", p.pid, g)
	}
	t.Logf("mid-kernel migrate: quiesce %d us (shim), downtime %s, wall %s, relaunched %d; steps: %s",
		pr.Quiesce.ElapsedUS, mr.Downtime, wall, pr.Resume.Relaunched, stepSummary(mr.Timings))
	ref := reference(t, "longgrid", append(fixed, "--device", "0")...)
	waitExit(t, p.pid, 4*time.Minute)
	sameResults(t, results(p.log), ref)
}

// stepSummary prints an operation's step times compactly for the test log.
func stepSummary(ts any) string {
	b, _ := json.Marshal(ts)
	return string(b)
}

// memOn returns how much GPU memory pid holds on each GPU index, as NVML shows it.
func memOn(t *testing.T, pid int) map[int]uint64 {
	t.Helper()
	m := map[int]uint64{}
	for _, u := range usedBy(t, pid) {
		m[u.Device.Index] = u.Memory
	}
	return m
}

// wantHeavier checks that pid uses both GPUs and holds more memory on GPU heavy than on the other
// (twogpu's device 1 holds twice device 0's buffer, so the heavier GPU is where its device 1 is).
func wantHeavier(t *testing.T, pid, heavy int, when string) {
	t.Helper()
	m := memOn(t, pid)
	t.Logf("%s: pid %d GPU memory by GPU index (bytes): %v", when, pid, m)
	if len(m) != 2 {
		t.Fatalf("%s: pid %d uses %d GPUs (%v), want 2", when, pid, len(m), m)
	}
	if m[heavy] <= m[1-heavy] {
		t.Fatalf("%s: pid %d holds %d MiB on GPU %d and %d MiB on GPU %d; its larger buffer should be on GPU %d",
			when, pid, m[heavy]>>20, heavy, m[1-heavy]>>20, 1-heavy, heavy)
	}
}

// TestProcessOnBothGPUs: one process with a context, memory and kernels on each GPU, copying data
// from one to the other every step (twogpu), is checkpointed (both GPUs recorded), restored with
// the GPUs swapped (--gpu-map 0=1,1=0), then migrated back with the same map; every step's
// checksums equal an uninterrupted run's, and NVML shows its larger buffer on the GPU the map
// says. With --p2p (peer access enabled, a kernel on one GPU reading the other's memory): under
// the shim its peer access is off for every operation and the process finishes exactly; without
// the shim the driver's answer is recorded (measured: no restore) and the image must survive the
// failed restores.
func TestProcessOnBothGPUs(t *testing.T) {
	devs := need(t, 2)
	if n := visibleHere(t, devs); n < 2 {
		t.Skipf("needs both GPUs visible to the workload, CUDA_VISIBLE_DEVICES leaves %d", n)
	}
	args := []string{"--mib", "256", "--steps", "60"}
	t.Run("staged", func(t *testing.T) {
		ref := referenceAsync(t, "twogpu", append(args, "--interval-ms", "0")...)
		p := start(t, "twogpu", append(args, "--interval-ms", "100")...)
		waitLine(t, p.log, "step 10 ", 2*time.Minute)
		wantHeavier(t, p.pid, 1, "before the checkpoint")
		so, se, code := ptxmig(t, "--json", "checkpoint", "--name", "twogpu", strconv.Itoa(p.pid))
		if code != 0 {
			t.Fatalf("checkpoint of a process on two GPUs: exit %d: %s", code, se)
		}
		var cr checkpoint.Result
		if err := json.Unmarshal([]byte(so), &cr); err != nil || cr.Kind != "cuda" || len(cr.GPUs) != 2 {
			t.Fatalf("checkpoint result %+v (%v), want both GPUs recorded", cr, err)
		}
		<-p.done
		so, se, code = ptxmig(t, "--json", "restore", "--gpu-map", "0=1,1=0", "twogpu")
		if code != 0 {
			t.Fatalf("restore --gpu-map 0=1,1=0: exit %d: %s", code, se)
		}
		var rr restore.Result
		if err := json.Unmarshal([]byte(so), &rr); err != nil || !rr.Remapped || len(rr.Pairs) != 2 {
			t.Fatalf("restore result %+v (%v), want two pairs given to the driver", rr, err)
		}
		logPairs(t, "restore --gpu-map 0=1,1=0", rr.Pairs)
		wantHeavier(t, p.pid, 0, "after the restore with the GPUs swapped")
		so, se, code = ptxmig(t, "--json", "migrate", "--gpu-map", "0=1,1=0", strconv.Itoa(p.pid))
		if code != 0 {
			t.Fatalf("migrate --gpu-map 0=1,1=0: exit %d: %s", code, se)
		}
		var mr migrate.Result
		if err := json.Unmarshal([]byte(so), &mr); err != nil || len(mr.Pairs) != 2 {
			t.Fatalf("migrate result %+v (%v)", mr, err)
		}
		logPairs(t, "migrate --gpu-map 0=1,1=0", mr.Pairs)
		t.Logf("migrate of a process on two GPUs: downtime %s; steps %s", mr.Downtime, stepSummary(mr.Timings))
		wantHeavier(t, p.pid, 1, "after migrating back")
		waitExit(t, p.pid, 3*time.Minute)
		sameResults(t, results(p.log), <-ref)
	})
	p2pArgs := append(append([]string{}, args...), "--p2p")
	record := func(t *testing.T, what string) {
		t.Log(what)
		if f, err := os.OpenFile(filepath.Join(out, "gputest", "twogpu-p2p.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644); err == nil {
			fmt.Fprintf(f, "%s: %s\n", t.Name(), what)
			f.Close()
		}
	}
	// Under the shim, its peer access is turned off after each quiesce and on again when it
	// resumes (driver 580 restores such a process only so): checkpoint --leave-running, migrate
	// with the GPUs swapped and back, a checkpoint that ends it and a restore, and the checksums of
	// an uninterrupted run (its kernels read the other GPU's memory every step).
	t.Run("p2p, under the shim", func(t *testing.T) {
		// 64 MiB: device 1 holds 128 MiB in one allocation (over 256 MiB is refused: below).
		long := []string{"--mib", "64", "--steps", "300", "--p2p"}
		ref := referenceAsync(t, "twogpu", append(long, "--interval-ms", "0")...)
		// The shim's diagnostics (PTXMIG_DEBUG=1: every peer link it enables, disables or drops)
		// go to the process's log under $PTXMIG_OUT.
		shim := os.Getenv("PTXMIG_SHIM")
		if shim == "" {
			t.Skip("PTXMIG_SHIM not set (run through gpu-e2e.sh)")
		}
		p := startEnv(t, []string{"PTXMIG_DEBUG=1"}, bin, append([]string{"run", "--shim", shim, "--socket-dir", filepath.Join(t.TempDir(), "sock"),
			"--preempt", "off", "--", filepath.Join(workloads, "twogpu")}, append(long, "--interval-ms", "100")...)...)
		waitLine(t, p.log, "step 10 ", 2*time.Minute)
		// Every operation must find both links (each device reads the other's memory): a link
		// dropped at a resume would fault the process at its next step.
		peerOff := func(reports []*shimstep.PreemptReport, what string) int64 {
			for _, r := range reports {
				if r.PID == p.pid && r.PeerOff != nil && r.PeerOff.Links > 0 {
					if r.PeerOff.Links != 2 {
						t.Fatalf("%s: %d peer links turned off, want 2", what, r.PeerOff.Links)
					}
					return r.PeerOff.ElapsedUS
				}
			}
			t.Fatalf("%s: no peer access turned off (reports %+v)", what, reports)
			return 0
		}
		so, se, code := ptxmig(t, "--json", "checkpoint", "--leave-running", "--name", "twogpu-p2p-shim-lr", strconv.Itoa(p.pid))
		if code != 0 {
			t.Fatalf("checkpoint --leave-running of a process with peer access: exit %d: %s", code, se)
		}
		var cr checkpoint.Result
		if err := json.Unmarshal([]byte(so), &cr); err != nil {
			t.Fatal(err)
		}
		us := peerOff(cr.Preemption, "checkpoint --leave-running")
		progresses(t, p, time.Minute, "checkpoint --leave-running")
		var downs []string
		for i, heavy := range []int{0, 1} {
			so, se, code := ptxmig(t, "--json", "migrate", "--gpu-map", "0=1,1=0", strconv.Itoa(p.pid))
			if code != 0 {
				t.Fatalf("migrate %d of a process with peer access: exit %d: %s", i, code, se)
			}
			var mr migrate.Result
			if err := json.Unmarshal([]byte(so), &mr); err != nil {
				t.Fatal(err)
			}
			peerOff(mr.Preemption, "migrate")
			downs = append(downs, mr.Downtime.Round(time.Millisecond).String())
			wantHeavier(t, p.pid, heavy, fmt.Sprintf("p2p: after migrate %d", i))
			progresses(t, p, time.Minute, "the migrate")
		}
		so, se, code = ptxmig(t, "--json", "checkpoint", "--name", "twogpu-p2p-shim", strconv.Itoa(p.pid))
		if code != 0 {
			t.Fatalf("checkpoint of a process with peer access: exit %d: %s", code, se)
		}
		<-p.done
		if _, se, code := ptxmig(t, "restore", "twogpu-p2p-shim"); code != 0 {
			t.Fatalf("restore of a process with peer access: exit %d: %s", code, se)
		}
		waitExit(t, p.pid, 3*time.Minute)
		sameResults(t, results(p.log), <-ref)
		record(t, fmt.Sprintf("peer access off for each operation (peer-off %s): checkpoint --leave-running, migrate --gpu-map 0=1,1=0 twice (downtime %s), checkpoint + restore; checksums exact",
			time.Duration(us)*time.Microsecond, strings.Join(downs, ", ")))
	})
	// Driver 580 cannot enable peer access toward a context holding a cudaMalloc allocation over
	// 256 MiB after a restore (CUDA_ERROR_INVALID_HANDLE: the process would be left held): with
	// 512 MiB on device 1 the checkpoint is refused up front naming the way out, and the process
	// runs on to the checksums of an uninterrupted run.
	t.Run("p2p, a large allocation: refused", func(t *testing.T) {
		big := []string{"--mib", "256", "--steps", "80", "--p2p"}
		ref := referenceAsync(t, "twogpu", append(big, "--interval-ms", "0")...)
		p := startShimmed(t, "off", "twogpu", append(big, "--interval-ms", "100")...)
		waitLine(t, p.log, "step 10 ", 2*time.Minute)
		_, se, code := ptxmig(t, "checkpoint", "--leave-running", "--name", "twogpu-p2p-big", strconv.Itoa(p.pid))
		if code != 3 || !strings.Contains(se, "allocation of 512 MiB") || !strings.Contains(se, "--no-peer-access") {
			t.Fatalf("checkpoint of a process with peer access and 512 MiB in one allocation: exit %d, want 3 naming the way out: %s", code, se)
		}
		progresses(t, p, time.Minute, "the refusal")
		waitExit(t, p.pid, 3*time.Minute)
		sameResults(t, results(p.log), <-ref)
		record(t, "512 MiB in one allocation beside peer access: refused up front (exit 3), ran on, checksums exact")
	})
	// Without the shim ptxmig cannot tell: the driver's answer is recorded. Measured with driver
	// 580.159.04: the checkpoint succeeds and every restore fails with CUDA_ERROR_INVALID_VALUE;
	// the image must stay intact through the failed restores (verified by the store).
	t.Run("p2p, no shim: the driver's answer", func(t *testing.T) {
		ref := referenceAsync(t, "twogpu", append(p2pArgs, "--interval-ms", "0")...)
		p := start(t, "twogpu", append(p2pArgs, "--interval-ms", "100")...)
		waitLine(t, p.log, "step 10 ", 2*time.Minute)
		so, se, code, timedOut := ptxmigWithin(t, 2*time.Minute, "--json", "checkpoint", "--lock-timeout", "20s", "--name", "twogpu-p2p", strconv.Itoa(p.pid))
		if timedOut || code != 0 {
			record(t, fmt.Sprintf("checkpoint: exit %d, timed out %v: %s", code, timedOut, strings.TrimSpace(se)))
			if s, err := procfs.ReadStat(p.pid); err != nil || s.Stopped() {
				t.Fatalf("the failed checkpoint left pid %d %+v (%v)", p.pid, s, err)
			}
			waitExit(t, p.pid, 3*time.Minute)
			sameResults(t, results(p.log), <-ref)
			return
		}
		var cr checkpoint.Result
		if err := json.Unmarshal([]byte(so), &cr); err != nil || len(cr.GPUs) != 2 {
			t.Fatalf("checkpoint result %+v (%v), want both GPUs recorded", cr, err)
		}
		<-p.done
		for _, swap := range []bool{true, false} {
			restore, heavy := []string{"restore", "twogpu-p2p"}, 1
			if swap {
				restore, heavy = []string{"restore", "--gpu-map", "0=1,1=0", "twogpu-p2p"}, 0
			}
			_, se, code := ptxmig(t, restore...)
			if code == 0 {
				record(t, fmt.Sprintf("checkpoint succeeded; %v succeeded", restore))
				wantHeavier(t, p.pid, heavy, "p2p: after the restore")
				waitExit(t, p.pid, 3*time.Minute)
				sameResults(t, results(p.log), <-ref)
				return
			}
			record(t, fmt.Sprintf("checkpoint succeeded; %v: exit %d: %s", restore, code, lastLine(se)))
			reap(t, p.pid, 30*time.Second) // the rollback ended the restored process
			if _, se, code := ptxmig(t, "image", "verify", "twogpu-p2p"); code != 0 {
				t.Fatalf("the image did not survive the failed restore: verify exit %d: %s", code, se)
			}
		}
		t.Logf("the driver restores no process with peer access (see %s); the image stayed intact", filepath.Join(out, "gputest", "twogpu-p2p.log"))
	})
}

// lastLine returns the last non-empty line of s.
func lastLine(s string) string {
	ls := strings.Split(strings.TrimSpace(s), "\n")
	return ls[len(ls)-1]
}
