package checkpoint_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ptxmig/ptxmig/checkpoint"
	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testproc"
	"github.com/ptxmig/ptxmig/internal/testreq"
	"github.com/ptxmig/ptxmig/restore"
)

// TestRestoreCgroup: a checkpoint records the tree's cgroups; a restore puts the process back in
// its recorded cgroup when it exists (wherever the restoring ptxmig runs), else in
// restore.DefaultCgroup (never re-creating the recorded one, never ptxmig's own), or in the
// cgroup asked for.
func TestRestoreCgroup(t *testing.T) {
	f := setup(t)
	mounts, err := proc.CgroupMounts()
	if err != nil {
		t.Fatal(err)
	}
	v2, ok := proc.UnifiedMount(mounts)
	if !ok {
		testreq.Skip(t, "cgroup2", "no cgroup v2 (unified) hierarchy mounted")
	}
	own, err := proc.Cgroup(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	suffix := hex.EncodeToString(b)
	job, other := "/ptxmig-test-job-"+suffix, "/ptxmig-test-other-"+suffix
	for _, cg := range []string{job, other} {
		if err := v2.Create(cg); err != nil {
			testreq.Skip(t, "cgroup2", "cannot create a cgroup: %v", err)
		}
		dir, _ := v2.Path(cg)
		t.Cleanup(func() { _ = os.Remove(dir) })
	}
	defaultExisted := v2.Exists(restore.DefaultCgroup)
	p, m := f.start(t, "state")
	pid := p.PID
	if err := v2.Move(job, pid); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = testproc.KillPID(pid, 10*time.Second)
		if !defaultExisted {
			dir, _ := v2.Path(restore.DefaultCgroup)
			_ = os.Remove(dir) // only when empty
		}
	})
	ckpt := func(name string) int {
		t.Helper()
		before, _ := testproc.ReadState(p.StateFile)
		res, err := checkpoint.Run(context.Background(), f.env, checkpoint.Options{PID: pid, Name: name, StagingRoot: f.stage})
		if err != nil {
			t.Fatal(err)
		}
		if res.Tree[0].Cgroup == "" {
			t.Fatalf("the checkpoint recorded no cgroup: %+v", res.Tree)
		}
		if err := proc.WaitGone(context.Background(), pid, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		return before.Step
	}
	restoreInto := func(name string, o restore.Options, want, reason string) {
		t.Helper()
		o.Image, o.StagingRoot = name, f.stage
		plan, err := restore.PlanRestore(context.Background(), f.env, o)
		if err != nil {
			t.Fatal(err)
		}
		if plan.Cgroup != want || !strings.Contains(plan.CgroupReason, reason) {
			t.Fatalf("plan: cgroup %q (%s), want %q (%s)", plan.Cgroup, plan.CgroupReason, want, reason)
		}
		res, err := restore.Execute(context.Background(), f.env, plan)
		if err != nil {
			t.Fatal(err)
		}
		got, err := proc.Cgroup(pid)
		if err != nil || got != want || res.Cgroup != want {
			t.Fatalf("restored into cgroup %q (result %q, %v), want %q", got, res.Cgroup, err, want)
		}
		if got == own && want != own {
			t.Fatalf("restored into the restoring process's own cgroup %s", own)
		}
	}

	step := ckpt("cg-1")
	m1, _ := f.st.Get("cg-1")
	if d1, err := imagedesc.Read(m1); err != nil || d1.Cgroup != job {
		t.Fatalf("image records cgroup %q (%v), want %s", d1.Cgroup, err, job)
	}
	restoreInto("cg-1", restore.Options{}, job, "recorded")
	advancesExactly(t, p.StateFile, m, step, 3)

	// The recorded cgroup is gone (the job's service ended): the default, and the recorded one is
	// not re-created.
	ckpt("cg-2")
	jobDir, _ := v2.Path(job)
	if err := os.Remove(jobDir); err != nil {
		t.Fatal(err)
	}
	restoreInto("cg-2", restore.Options{}, restore.DefaultCgroup, "does not exist")
	if v2.Exists(job) {
		t.Errorf("the restore re-created the missing cgroup %s", job)
	}

	// Asked for: that one; a missing one is refused before anything is touched.
	ckpt("cg-3")
	if _, err := restore.PlanRestore(context.Background(), f.env, restore.Options{Image: "cg-3", StagingRoot: f.stage, Cgroup: "/ptxmig-test-missing-" + suffix}); !errors.Is(err, op.ErrRefused) {
		t.Fatalf("restore into a missing cgroup: %v, want a refusal", err)
	}
	if _, err := restore.PlanRestore(context.Background(), f.env, restore.Options{Image: "cg-3", StagingRoot: f.stage, Cgroup: "/../etc"}); !errors.Is(err, op.ErrRefused) {
		t.Fatalf("restore into a bad cgroup path: %v, want a refusal", err)
	}
	restoreInto("cg-3", restore.Options{Cgroup: other}, other, "as asked")
	if got, _ := proc.Cgroup(pid); got != other {
		t.Fatalf("cgroup %q", got)
	}
}
