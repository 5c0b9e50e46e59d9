package proc

import "testing"

// TestKeepHierarchies: StartKept uses the unified hierarchy and systemd's v1 one where ptxmig is
// below their top and they are mounted; other v1 controllers never.
func TestKeepHierarchies(t *testing.T) {
	v2 := CgroupMount{Dir: "/sys/fs/cgroup", V2: true}
	unified := CgroupMount{Dir: "/sys/fs/cgroup/unified", V2: true}
	sd := CgroupMount{Dir: "/sys/fs/cgroup/systemd", Controllers: []string{"name=systemd"}}
	mem := CgroupMount{Dir: "/sys/fs/cgroup/memory", Controllers: []string{"memory"}}
	svc := "/system.slice/ptxmig-rebalance.service"
	for _, tc := range []struct {
		name          string
		own           []CgroupEntry
		mounts        []CgroupMount
		want2, wantSD string // mount dirs, "" for none
	}{
		{"v2 host, a service", []CgroupEntry{{ID: 0, Path: svc}}, []CgroupMount{v2}, v2.Dir, ""},
		{"v2 host, at the top", []CgroupEntry{{ID: 0, Path: "/"}}, []CgroupMount{v2}, "", ""},
		{"hybrid host, a service", []CgroupEntry{{ID: 0, Path: svc}, {ID: 1, Controllers: "name=systemd", Path: svc}, {ID: 4, Controllers: "memory", Path: svc}},
			[]CgroupMount{unified, sd, mem}, unified.Dir, sd.Dir},
		{"hybrid host, unified at the top", []CgroupEntry{{ID: 0, Path: "/"}, {ID: 1, Controllers: "name=systemd", Path: svc}},
			[]CgroupMount{unified, sd}, "", sd.Dir},
		{"v1 only, memory cgroup", []CgroupEntry{{ID: 4, Controllers: "memory", Path: "/process_api/x"}}, []CgroupMount{mem}, "", ""},
		{"v2 not mounted", []CgroupEntry{{ID: 0, Path: svc}}, nil, "", ""},
	} {
		got2, gotSD := keepHierarchies(tc.own, tc.mounts)
		dir := func(m *CgroupMount) string {
			if m == nil {
				return ""
			}
			return m.Dir
		}
		if dir(got2) != tc.want2 || dir(gotSD) != tc.wantSD {
			t.Errorf("%s: v2 %q, systemd %q; want %q, %q", tc.name, dir(got2), dir(gotSD), tc.want2, tc.wantSD)
		}
	}
}
