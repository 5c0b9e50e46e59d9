package proc

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Control groups: where a process belongs (/proc/PID/cgroup), where the hierarchies are mounted
// (/proc/self/mountinfo), and moving a process (cgroup.procs). Paths are those /proc/PID/cgroup
// shows: absolute, relative to the reader's cgroup namespace root.

// ErrNoCgroup: the process has no cgroup in that hierarchy, or the hierarchy is not mounted.
var ErrNoCgroup = errors.New("no such cgroup")

// MaxCgroupPath bounds a cgroup path taken from an image or a journal.
const MaxCgroupPath = 4096

// CgroupEntry is one line of /proc/PID/cgroup, "ID:CONTROLLERS:PATH". The unified (v2) hierarchy
// is ID 0 with no controllers.
type CgroupEntry struct {
	ID          int    `json:"id"`
	Controllers string `json:"controllers"` // "memory", "cpu,cpuacct", "name=systemd"; "" for v2
	Path        string `json:"path"`
}

// V2 reports whether e is the unified hierarchy.
func (e CgroupEntry) V2() bool { return e.ID == 0 && e.Controllers == "" }

// ParseCgroups parses /proc/PID/cgroup. Lines whose path is not a valid cgroup path (a process
// of another cgroup namespace shows "/.." paths) are left out.
func ParseCgroups(b []byte) ([]CgroupEntry, error) {
	var out []CgroupEntry
	for line := range bytes.SplitSeq(b, []byte{'\n'}) {
		if len(line) == 0 {
			continue
		}
		f := strings.SplitN(string(line), ":", 3)
		if len(f) != 3 {
			return nil, fmt.Errorf("malformed cgroup line %q", line)
		}
		id, err := strconv.Atoi(f[0])
		if err != nil || id < 0 {
			return nil, fmt.Errorf("malformed cgroup line %q", line)
		}
		if ValidCgroupPath(f[2]) != nil {
			continue
		}
		out = append(out, CgroupEntry{ID: id, Controllers: f[1], Path: f[2]})
	}
	return out, nil
}

// Cgroups reads /proc/PID/cgroup.
func Cgroups(pid int) ([]CgroupEntry, error) {
	b, err := ReadFile(Root, pid, "cgroup", MaxSmall)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("pid %d: %w", pid, ErrNoProcess)
	}
	if err != nil {
		return nil, fmt.Errorf("pid %d: %w", pid, err)
	}
	return ParseCgroups(b)
}

// Cgroup is pid's cgroup in the unified (v2) hierarchy, as /proc/PID/cgroup's "0::" line names
// it ("/system.slice/job.service"). It wraps ErrNoCgroup when the process has none (a host with
// cgroup v1 only).
func Cgroup(pid int) (string, error) {
	es, err := Cgroups(pid)
	if err != nil {
		return "", err
	}
	for _, e := range es {
		if e.V2() {
			return e.Path, nil
		}
	}
	return "", fmt.Errorf("pid %d: %w in the unified (v2) hierarchy", pid, ErrNoCgroup)
}

// ValidCgroupPath accepts what a cgroup path may be: absolute, clean (no "." or ".." element, no
// repeated or trailing slash), printable, at most MaxCgroupPath bytes.
func ValidCgroupPath(p string) error {
	switch {
	case p == "" || p[0] != '/':
		return fmt.Errorf("cgroup path %q is not absolute", p)
	case len(p) > MaxCgroupPath:
		return fmt.Errorf("cgroup path longer than %d bytes", MaxCgroupPath)
	case filepath.Clean(p) != p:
		return fmt.Errorf("cgroup path %q is not clean", p)
	case strings.ContainsFunc(p, func(r rune) bool { return r < ' ' || r == 0x7f }):
		return fmt.Errorf("cgroup path %q holds control characters", p)
	}
	return nil
}

// CgroupMount is one mounted cgroup hierarchy.
type CgroupMount struct {
	Dir         string   // mount point
	V2          bool     // the unified hierarchy
	Controllers []string // v1: the controllers (and name=...) of its super options
}

// v1Options are super options of a cgroup v1 mount that are not controllers.
var v1Options = []string{"rw", "ro", "relatime", "noatime", "nodiratime", "xattr", "noprefix", "clone_children",
	"cpuset_v2_mode", "favordynmods", "nsdelegate", "memory_recursiveprot", "memory_localevents",
	"memory_hugetlb_accounting", "none"}

// ParseCgroupMounts lists the cgroup hierarchies of a mountinfo listing that are mounted at the
// root of the hierarchy (bind mounts of a sub-cgroup are left out).
func ParseCgroupMounts(mountinfo []byte) []CgroupMount {
	var out []CgroupMount
	for line := range bytes.SplitSeq(mountinfo, []byte{'\n'}) {
		f := strings.Fields(string(line))
		sep := slices.Index(f, "-")
		if sep < 6 || len(f) < sep+4 || f[3] != "/" {
			continue
		}
		fstype, super := f[sep+1], f[sep+3]
		m := CgroupMount{Dir: unescapeMount(f[4])}
		switch fstype {
		case "cgroup2":
			m.V2 = true
		case "cgroup":
			for _, o := range strings.Split(super, ",") {
				if !slices.Contains(v1Options, o) && !strings.HasPrefix(o, "release_agent=") {
					m.Controllers = append(m.Controllers, o)
				}
			}
		default:
			continue
		}
		out = append(out, m)
	}
	return out
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// CgroupMounts lists this process's mounted cgroup hierarchies.
func CgroupMounts() ([]CgroupMount, error) {
	b, err := ReadFile(Root, os.Getpid(), "mountinfo", 4*MaxSmall)
	if err != nil {
		return nil, err
	}
	return ParseCgroupMounts(b), nil
}

// UnifiedMount is the mounted cgroup v2 hierarchy among mounts, if any.
func UnifiedMount(mounts []CgroupMount) (CgroupMount, bool) {
	for _, m := range mounts {
		if m.V2 {
			return m, true
		}
	}
	return CgroupMount{}, false
}

// MountOf finds where the hierarchy of e is mounted.
func MountOf(mounts []CgroupMount, e CgroupEntry) (CgroupMount, bool) {
	for _, m := range mounts {
		if e.V2() {
			if m.V2 {
				return m, true
			}
			continue
		}
		if m.V2 || e.Controllers == "" {
			continue
		}
		all := true
		for _, c := range strings.Split(e.Controllers, ",") {
			all = all && slices.Contains(m.Controllers, c)
		}
		if all {
			return m, true
		}
	}
	return CgroupMount{}, false
}

// Path is the directory of cgroup path p in the hierarchy (p must be valid).
func (m CgroupMount) Path(p string) (string, error) {
	if err := ValidCgroupPath(p); err != nil {
		return "", err
	}
	return filepath.Join(m.Dir, p), nil
}

// Exists reports whether cgroup p exists in the hierarchy.
func (m CgroupMount) Exists(p string) bool {
	dir, err := m.Path(p)
	if err != nil {
		return false
	}
	var st unix.Stat_t
	return unix.Lstat(dir, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR
}

// Create makes cgroup p (and missing parents) in the hierarchy.
func (m CgroupMount) Create(p string) error {
	dir, err := m.Path(p)
	if err != nil {
		return err
	}
	return os.MkdirAll(dir, 0o755)
}

// Move puts pid (the whole process, every thread) into cgroup p of the hierarchy.
func (m CgroupMount) Move(p string, pid int) error {
	dir, err := m.Path(p)
	if err != nil {
		return err
	}
	fd, err := unix.Open(filepath.Join(dir, "cgroup.procs"), unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("move pid %d to cgroup %s: %w", pid, p, err)
	}
	defer unix.Close(fd)
	if _, err := unix.Write(fd, []byte(strconv.Itoa(pid))); err != nil {
		return fmt.Errorf("move pid %d to cgroup %s: %w", pid, p, err)
	}
	return nil
}
