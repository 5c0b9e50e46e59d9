package restore

import (
	"fmt"
	"log/slog"
	"strings"

	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/proc"
)

// Where restored processes go (cgroups). CRIU's own placement follows paths relative to the
// restorer's cgroup (a process that shared ptxmig's cgroup at checkpoint lands in the restoring
// ptxmig's, and dies with its service or job step) and re-creates missing cgroups, so ptxmig
// places the processes itself and tells CRIU to leave cgroups alone:
//
//   - cgroup v2 (the unified hierarchy): each process goes to the cgroup recorded for it at
//     checkpoint when that exists on this host, else where the root goes. The root goes to its
//     recorded cgroup when it exists, else to DefaultCgroup (created when missing), never to
//     ptxmig's own. Options.Cgroup puts the whole tree into one existing cgroup instead. CRIU
//     itself starts in the root's target (CLONE_INTO_CGROUP), so the processes are born there and
//     their memory is charged there.
//   - cgroup v1 hierarchies (hybrid or legacy hosts): after the restore, each process is moved to
//     the root's recorded cgroup of that hierarchy when it exists, else to the hierarchy's root.

// DefaultCgroup is the cgroup v2 path restored processes go to when the image's cgroup does not
// exist on this host (and no cgroup was asked for): a cgroup of ptxmig's own, outside any
// service or job, created when missing.
const DefaultCgroup = "/ptxmig"

// cgroupPlan is where a restore puts the tree.
type cgroupPlan struct {
	v2      *proc.CgroupMount // nil: no unified hierarchy here
	target  string            // the root's v2 cgroup ("" without v2)
	option  bool              // target is Options.Cgroup: the whole tree goes there
	create  bool              // target is DefaultCgroup and does not exist yet
	v1      []v1Target        // per v1 hierarchy
	why     string            // for the plan
	perProc map[int]string    // recorded v2 cgroups per pid
}

type v1Target struct {
	m    proc.CgroupMount
	path string
}

// planCgroups decides where the tree goes (it touches nothing).
func planCgroups(p *Plan, o Options) (*cgroupPlan, error) {
	if err := p.meta.Problem(imagedesc.FieldCgroups); err != nil {
		return nil, op.Refusef("image %s: %w", p.Image, err)
	}
	recorded, recordedV1 := p.meta.Cgroup, p.meta.CgroupV1
	mounts, err := proc.CgroupMounts()
	if err != nil {
		return nil, op.Refusef("read the cgroup mounts: %w", err)
	}
	cp := &cgroupPlan{perProc: map[int]string{}}
	for _, t := range p.Tree {
		if t.Cgroup != "" {
			cp.perProc[t.PID] = t.Cgroup
		}
	}
	if m, ok := proc.UnifiedMount(mounts); ok {
		cp.v2 = &m
	}
	switch {
	case o.Cgroup != "":
		if err := proc.ValidCgroupPath(o.Cgroup); err != nil {
			return nil, op.Refusef("cgroup: %w", err)
		}
		if cp.v2 == nil {
			return nil, op.Refusef("cgroup %s: this host has no cgroup v2 (unified) hierarchy mounted", o.Cgroup)
		}
		if !cp.v2.Exists(o.Cgroup) {
			return nil, op.Refusef("cgroup %s does not exist (%s)", o.Cgroup, strings.TrimSuffix(cp.v2.Dir, "/")+o.Cgroup)
		}
		cp.target, cp.option, cp.why = o.Cgroup, true, "as asked"
	case cp.v2 == nil:
		cp.why = "no cgroup v2 hierarchy on this host"
	case recorded != "" && cp.v2.Exists(recorded):
		cp.target, cp.why = recorded, "recorded at checkpoint"
	default:
		cp.target = DefaultCgroup
		cp.create = !cp.v2.Exists(DefaultCgroup)
		if recorded == "" {
			cp.why = "the default: the image records no cgroup"
		} else {
			cp.why = fmt.Sprintf("the default: the recorded cgroup %s does not exist on this host", recorded)
		}
	}
	for _, m := range mounts {
		if m.V2 {
			continue
		}
		t := v1Target{m: m, path: "/"}
		for key, path := range recordedV1 {
			if mm, ok := proc.MountOf([]proc.CgroupMount{m}, proc.CgroupEntry{ID: 1, Controllers: key}); ok && mm.Dir == m.Dir && m.Exists(path) {
				t.path = path
			}
		}
		cp.v1 = append(cp.v1, t)
	}
	return cp, nil
}

// describe is the plan's line.
func (cp *cgroupPlan) describe() string {
	if cp.target == "" {
		return cp.why
	}
	return fmt.Sprintf("cgroup %s (%s)", cp.target, cp.why)
}

// prepare creates the default cgroup when it is the target; it returns the directory CRIU
// starts in ("" for none).
func (cp *cgroupPlan) prepare() (string, error) {
	if cp.v2 == nil || cp.target == "" {
		return "", nil
	}
	if cp.create {
		if err := cp.v2.Create(cp.target); err != nil {
			return "", fmt.Errorf("create cgroup %s: %w", cp.target, err)
		}
	}
	return cp.v2.Path(cp.target)
}

// targetOf is where pid goes in the v2 hierarchy.
func (cp *cgroupPlan) targetOf(pid int) string {
	if cp.option {
		return cp.target
	}
	if c, ok := cp.perProc[pid]; ok && cp.v2.Exists(c) {
		return c
	}
	return cp.target
}

// place moves every restored process where it belongs (those CRIU started in the right v2
// cgroup stay). A v2 failure fails the restore; a v1 one is logged.
func (cp *cgroupPlan) place(pids []int, log *slog.Logger) error {
	for _, pid := range pids {
		if !proc.Alive(pid) {
			continue
		}
		if cp.v2 != nil && cp.target != "" {
			want := cp.targetOf(pid)
			if cur, err := proc.Cgroup(pid); err != nil || cur != want {
				if err := cp.v2.Move(want, pid); err != nil {
					return err
				}
			}
		}
		for _, t := range cp.v1 {
			if err := t.m.Move(t.path, pid); err != nil {
				log.Warn("cannot place a restored process in its cgroup v1", "pid", pid, "hierarchy", strings.Join(t.m.Controllers, ","), "cgroup", t.path, "err", err)
			}
		}
	}
	return nil
}
