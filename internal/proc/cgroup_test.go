package proc

import (
	"reflect"
	"testing"
)

func TestParseCgroups(t *testing.T) {
	in := "12:cpu,cpuacct:/user.slice\n9:name=systemd:/system.slice/job.service\n1:memory:/..\n0::/system.slice/job.service\n"
	got, err := ParseCgroups([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []CgroupEntry{{12, "cpu,cpuacct", "/user.slice"}, {9, "name=systemd", "/system.slice/job.service"}, {0, "", "/system.slice/job.service"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("ParseCgroups = %+v, want %+v (a path outside the namespace, /.., is left out)", got, want)
	}
	if !got[2].V2() || got[0].V2() {
		t.Error("V2 wrong")
	}
	for _, bad := range []string{"x::/", "0:/", "-1::/"} {
		if _, err := ParseCgroups([]byte(bad)); err == nil {
			t.Errorf("ParseCgroups(%q) accepted", bad)
		}
	}
	for p, ok := range map[string]bool{"/": true, "/a/b": true, "": false, "a": false, "/a/../b": false, "/a/": false, "/a\nb": false} {
		if (ValidCgroupPath(p) == nil) != ok {
			t.Errorf("ValidCgroupPath(%q) = %v", p, ValidCgroupPath(p))
		}
	}
}

func TestParseCgroupMounts(t *testing.T) {
	mi := `35 24 0:30 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
37 35 0:32 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:11 - cgroup cgroup rw,cpu,cpuacct
38 35 0:33 / /sys/fs/cgroup/systemd rw,nosuid shared:12 - cgroup cgroup rw,xattr,name=systemd,release_agent=/x
39 35 0:34 /sub /mnt/bind\040dir rw - cgroup cgroup rw,memory
40 35 0:35 / /mnt/space\040dir rw - cgroup cgroup rw,pids
`
	got := ParseCgroupMounts([]byte(mi))
	want := []CgroupMount{{Dir: "/sys/fs/cgroup/unified", V2: true}, {Dir: "/sys/fs/cgroup/cpu,cpuacct", Controllers: []string{"cpu", "cpuacct"}},
		{Dir: "/sys/fs/cgroup/systemd", Controllers: []string{"name=systemd"}}, {Dir: "/mnt/space dir", Controllers: []string{"pids"}}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("ParseCgroupMounts = %+v\nwant %+v", got, want)
	}
	for _, tt := range []struct {
		e    CgroupEntry
		want string
	}{
		{CgroupEntry{0, "", "/"}, "/sys/fs/cgroup/unified"},
		{CgroupEntry{3, "cpu,cpuacct", "/"}, "/sys/fs/cgroup/cpu,cpuacct"},
		{CgroupEntry{3, "cpuacct", "/"}, "/sys/fs/cgroup/cpu,cpuacct"},
		{CgroupEntry{9, "name=systemd", "/"}, "/sys/fs/cgroup/systemd"},
		{CgroupEntry{4, "memory", "/"}, ""},
	} {
		m, ok := MountOf(got, tt.e)
		if (tt.want == "") == ok || (ok && m.Dir != tt.want) {
			t.Errorf("MountOf(%+v) = %+v, %v; want %q", tt.e, m, ok, tt.want)
		}
	}
	if p, err := got[0].Path("/../etc"); err == nil {
		t.Errorf("Path(/../etc) = %q, want an error", p)
	}
}
