//go:build gpu

package gputest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	procfs "github.com/ptxmig/ptxmig/internal/proc"
)

// NCCL's transports that a driver checkpoint can take: the ranks exchange data through sockets
// (P2P and shared memory map GPU or host memory between the rank processes; cuMem shares
// allocations through file descriptors). NVLink multicast stays off on shared hosts. PyTorch's
// TCPStore server (rank 0) must not use libuv, whose io_uring instance CRIU cannot dump
// (UV_USE_IO_URING=0 did not remove it; USE_LIBUV=0 did: 2x H200, PyTorch 2.11, 2026-11-28).
var ncclSockets = []string{"NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "NCCL_CUMEM_ENABLE=0", "NCCL_NVLS_ENABLE=0", "USE_LIBUV=0"}

// ddpArgs runs ddp.py (a parent spawning one rank per GPU) with its own rendezvous port.
func ddpArgs(port int) []string {
	return []string{filepath.Join(workloads, "ddp.py"), "--world", "2", "--steps", "300", "--log-every", "10",
		"--sleep-ms", "20", "--port", strconv.Itoa(port)}
}

// ddpReference is an uninterrupted run of the job with env, plain (no shim).
func ddpReference(t *testing.T, env []string, port int) <-chan []string {
	t.Helper()
	ref := make(chan []string, 1)
	done := make(chan struct{})
	t.Cleanup(func() { <-done })
	go func() {
		defer close(done)
		p := startEnv(t, env, "/usr/bin/env", append([]string{"python3"}, ddpArgs(port)...)...)
		select {
		case <-p.done:
		case <-time.After(5 * time.Minute):
			t.Errorf("reference DDP run did not finish")
		}
		ref <- results(p.log)
	}()
	return ref
}

// startJob starts the DDP job under `ptxmig run` (the shim in the parent and every rank), with
// run's flags.
func startJob(t *testing.T, env, flags []string, port int) *proc {
	t.Helper()
	shim := os.Getenv("PTXMIG_SHIM")
	if shim == "" {
		t.Skip("PTXMIG_SHIM not set (run through gpu-e2e.sh)")
	}
	runArgs := append(append([]string{"run", "--shim", shim, "--socket-dir", filepath.Join(t.TempDir(), "sock")}, flags...), "--", "python3")
	runArgs = append(runArgs, ddpArgs(port)...)
	p := startEnv(t, env, bin, runArgs...)
	waitLine(t, p.log, "step 30 ", 4*time.Minute)
	return p
}

// jobPIDs is the job's tree (the parent first).
func jobPIDs(t *testing.T, root int) []int {
	t.Helper()
	stats, err := procfs.Tree(root)
	if err != nil {
		t.Fatalf("the job's tree: %v", err)
	}
	return procfs.PIDs(stats)
}

// TestJobDDP: a 2-rank PyTorch DDP job over NCCL (mp.spawn: one tree) under `ptxmig run`.
//   - With NCCL's default transports the ranks map each other's GPU memory, which the driver
//     cannot restore: the checkpoint is refused up front (exit 3) naming the way out, and the
//     job runs on untouched to the losses of an uninterrupted run.
//   - With socket transports: --leave-running checkpoints of the whole job (TCP connections
//     between the ranks included) either succeed or roll back (exit 4: a rank's NCCL kernel
//     waited for a rank already locked) and the job runs on; then a checkpoint that ends the job
//     and a restore, after which it finishes with the losses of an uninterrupted run.
func TestJobDDP(t *testing.T) {
	need(t, 2)
	t.Run("default-transports", func(t *testing.T) {
		ref := ddpReference(t, []string{"NCCL_NVLS_ENABLE=0"}, 29601)
		p := startJob(t, []string{"NCCL_NVLS_ENABLE=0"}, nil, 29602)
		_, se, code := ptxmig(t, "checkpoint", "--leave-running", "--tcp-established", strconv.Itoa(p.pid))
		if code != 3 || !strings.Contains(se, "NCCL_P2P_DISABLE=1") {
			t.Fatalf("checkpoint of a job on NCCL's default transports: exit %d, want 3 naming the way out:\n%s", code, se)
		}
		t.Logf("refused: %s", lastLine(se))
		select {
		case <-p.done:
		case <-time.After(5 * time.Minute):
			t.Fatal("the job did not finish after the refusal")
		}
		sameResults(t, results(p.log), <-ref)
	})
	t.Run("socket-transports", func(t *testing.T) {
		ref := ddpReference(t, ncclSockets, 29603)
		p := startJob(t, []string{"NCCL_NVLS_ENABLE=0"}, []string{"--nccl-sockets"}, 29604) // what the reference gets by hand
		tree := jobPIDs(t, p.pid)
		if len(tree) < 3 {
			t.Fatalf("job tree %v: want the parent and two ranks", tree)
		}
		var outcomes []string
		for i := 0; i < 5; i++ {
			t0 := time.Now()
			_, se, code := ptxmig(t, "checkpoint", "--leave-running", "--tcp-established", "--lock-timeout", "5s",
				"--name", fmt.Sprintf("ddp-live-%d", i), strconv.Itoa(p.pid))
			took := time.Since(t0)
			switch code {
			case 0:
				outcomes = append(outcomes, fmt.Sprintf("ok %.2fs", took.Seconds()))
			case 4:
				outcomes = append(outcomes, fmt.Sprintf("rolled back %.2fs (%s)", took.Seconds(), lastLine(se)))
			default:
				t.Fatalf("checkpoint --leave-running %d of the job: exit %d, want 0 or 4:\n%s", i, code, se)
			}
			for _, pid := range tree {
				if s, err := procfs.ReadStat(pid); err != nil || s.Stopped() {
					t.Fatalf("after checkpoint %d, pid %d is stopped or gone (%v)", i, pid, err)
				}
			}
			n := len(results(p.log))
			deadline := time.Now().Add(2 * time.Minute)
			for len(results(p.log)) == n {
				if time.Now().After(deadline) {
					t.Fatalf("the job made no progress after checkpoint %d (%s)", i, outcomes[len(outcomes)-1])
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
		t.Logf("--leave-running checkpoints of the job: %s", strings.Join(outcomes, "; "))
		_, se, code := ptxmig(t, "checkpoint", "--tcp-established", "--lock-timeout", "5s", "--name", "ddp-job", strconv.Itoa(p.pid))
		switch code {
		case 0:
			<-p.done
			for _, pid := range tree {
				reap(t, pid, time.Minute)
			}
			so, se, code := ptxmig(t, "restore", "ddp-job")
			if code != 0 {
				t.Fatalf("restore of the job: exit %d\n%s\n%s", code, so, se)
			}
			waitExit(t, p.pid, 5*time.Minute)
		case 4:
			t.Logf("the checkpoint that ends the job rolled back (%s): the job runs on", lastLine(se))
			waitExit(t, p.pid, 5*time.Minute)
		default:
			t.Fatalf("checkpoint of the job: exit %d\n%s", code, se)
		}
		sameResults(t, results(p.log), <-ref)
	})
}
