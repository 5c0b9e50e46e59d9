// Package imagedesc is the typed description of a process image: what checkpoint records in a
// manifest's metadata (kind, provenance, GPUs, the process tree, cgroups, CRIU options, the host
// files it needs and those it carries, owned device memory) and restore, image inspect and the
// others read back. The store keeps it as opaque metadata (store.Metadata); this package alone
// encodes it, and validates every field it reads, since images come from elsewhere.
//
// Two layouts are read (docs/FORMAT.md, "Image description"): version 2, written since manifest
// format 2.0, whose fields are typed JSON members of the metadata object, and the layout before
// it (no "image" member), whose tree, cgroups and host files were JSON strings in "extra". Both
// decode into the same Description.
package imagedesc

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/ptxmig/ptxmig/internal/hostreq"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/store"
)

// Version is the layout this package writes (the metadata's "image" member). Readers refuse a
// description of a later version: what it adds could change how the image must be restored.
const Version = 2

// Kinds of images.
const (
	KindCUDA = "cuda"
	KindCPU  = "cpu"
)

// Keys of "extra" in the layout before version 2 (legacy): checkpoint wrote them, restore read
// them. Version 2 descriptions keep "extra" for labels only.
const (
	ExtraShellJob       = "criu.shell_job"
	ExtraTTY            = "criu.tty" // a process had a controlling terminal (restore needs one to inherit)
	ExtraTCPEstablished = "criu.tcp_established"
	ExtraNetworkLock    = "criu.network_lock" // how the dump blocked the connections: the restore does the same
	ExtraComm           = "comm"
	ExtraLeftRunning    = "left_running"
	ExtraTree           = "tree" // JSON list of TreeProc: the checkpointed process tree
	// ExtraCgroup is the root process's cgroup v2 path at checkpoint ("/system.slice/job.service").
	ExtraCgroup = "cgroup"
	// ExtraCgroupV1 is a JSON object of the root process's cgroup v1 paths at checkpoint, by
	// hierarchy (its controllers as /proc/PID/cgroup names them: "memory", "cpu,cpuacct",
	// "name=systemd").
	ExtraCgroupV1 = "cgroup.v1"
	// ExtraHostFiles is a JSON list of hostreq.File: what the target host must provide (absent
	// when it did not fit: restore then reads CRIU's files.img from the image).
	ExtraHostFiles = "host.files"
	// ExtraCarried is a JSON list of hostreq.Carried: files the image carries (--carry-files).
	ExtraCarried = "host.carried"
	// ExtraDevmem lists "pid:instance" of every process whose owned memory the image holds
	// (space-separated).
	ExtraDevmem = "devmem"
)

// legacyKeys are the extra keys the legacy layout gave a meaning; every other key is a label.
var legacyKeys = []string{ExtraShellJob, ExtraTTY, ExtraTCPEstablished, ExtraNetworkLock, ExtraComm, ExtraLeftRunning,
	ExtraTree, ExtraCgroup, ExtraCgroupV1, ExtraHostFiles, ExtraCarried, ExtraDevmem}

// Limits on what a description may hold (it is read from an image).
const (
	MaxPID       = 1 << 22 // the kernel's PID_MAX_LIMIT: pids are below it
	maxGPUs      = 1024
	maxTree      = 1 << 16
	maxCgroupsV1 = 64
	maxDevmem    = maxTree
	maxLabels    = 1024
)

// GPU describes one source GPU of a checkpointed process.
type GPU struct {
	Index       int    `json:"index"`
	UUID        string `json:"uuid,omitempty"`
	Name        string `json:"name,omitempty"`
	ComputeCap  string `json:"compute_cap,omitempty"`
	MemoryBytes uint64 `json:"memory_bytes,omitempty"`
}

// TreeProc is one process of a checkpointed tree.
type TreeProc struct {
	PID    int    `json:"pid"`
	PPID   int    `json:"ppid"`
	Comm   string `json:"comm"`
	CUDA   bool   `json:"cuda,omitempty"`
	Cgroup string `json:"cgroup,omitempty"` // its cgroup v2 path at checkpoint
}

// Description is what an image records about itself. The zero value describes a plain directory
// image (ptxmig image add) with nothing recorded.
type Description struct {
	Kind    string // KindCUDA, KindCPU, or empty for a plain directory
	Host    string
	Kernel  string
	Driver  string
	CUDA    string
	CRIU    string
	GPUs    []GPU // the GPUs the process used
	Visible []GPU // every GPU its CUDA driver enumerated (absent in older images)
	PID     int   // the root process (0: none)
	Cmdline []string
	Comm    string
	// Tree is the checkpointed process tree, root first, every parent before its children; nil
	// when none was recorded (Processes then gives the root alone).
	Tree []TreeProc
	// Cgroup is the root's cgroup v2 path at checkpoint, CgroupV1 its v1 paths by hierarchy.
	Cgroup   string
	CgroupV1 map[string]string
	// CRIU's options at the dump, which the restore repeats.
	ShellJob       bool
	TTY            bool // a process had a controlling terminal
	TCPEstablished bool
	NetworkLock    string // how the dump blocked the connections
	LeftRunning    bool
	// HostFiles are the files CRIU will reopen on the target host; HostFilesRecorded is false
	// when none were recorded (too many, or an older image): restore reads files.img then.
	HostFiles         []hostreq.File
	HostFilesRecorded bool
	Carried           []hostreq.Carried // files the image carries (--carry-files)
	Devmem            map[int]string    // pid → instance of the processes whose owned memory the image holds
	Labels            map[string]string // free-form (image add --label)
	// Legacy says the description was read from the layout before version 2.
	Legacy bool

	problems []Problem
}

// Processes is the recorded tree, or for images without one the root alone (CUDA when the image
// is).
func (d *Description) Processes() []TreeProc {
	if d.Tree != nil {
		return d.Tree
	}
	return []TreeProc{{PID: d.PID, Comm: d.Comm, CUDA: d.Kind == KindCUDA}}
}

// Problem is a field of a description that could not be read.
type Problem struct {
	Field string // the member ("tree", "host_files", …; legacy images: the extra key)
	Err   error
}

// InvalidError lists the fields of a description that could not be read.
type InvalidError struct{ Problems []Problem }

func (e *InvalidError) Error() string {
	var b strings.Builder
	for i, p := range e.Problems {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(p.Err.Error())
	}
	return b.String()
}

// Unwrap gives each field's error.
func (e *InvalidError) Unwrap() []error {
	out := make([]error, len(e.Problems))
	for i, p := range e.Problems {
		out[i] = p.Err
	}
	return out
}

// Problem returns the error that field had when it was read (nil: none).
func (d *Description) Problem(field string) error {
	for _, p := range d.problems {
		if p.Field == field {
			return p.Err
		}
	}
	return nil
}

// Fields that have problems of their own (Description.Problem).
const (
	FieldMeta      = "meta"
	FieldImage     = "image"
	FieldBase      = "base" // kind, host, versions, pid, cmdline, GPUs
	FieldTree      = "tree"
	FieldCgroups   = "cgroups"
	FieldCRIU      = "criu"
	FieldHostFiles = "host_files"
	FieldCarried   = "carried"
	FieldDevmem    = "devmem"
	FieldLabels    = "labels"
)

// Read decodes and validates the description of a manifest. The description holds every field
// that could be read; the error, an *InvalidError, names the others (an image with any is not to
// be restored, but can be shown).
func Read(m *store.Manifest) (*Description, error) { return Decode(m.Meta) }

// Decode decodes and validates encoded metadata (see Read).
func Decode(raw store.Metadata) (*Description, error) {
	d := &Description{}
	fail := func(field string, err error) { d.problems = append(d.problems, Problem{field, err}) }
	members := map[string]json.RawMessage{}
	if t := bytes.TrimSpace(raw); len(t) > 0 && string(t) != "null" {
		if err := json.Unmarshal(t, &members); err != nil {
			fail(FieldMeta, fmt.Errorf("image metadata: %w", err))
			return d, d.err()
		}
	}
	member := func(field, name string, v any) bool {
		r, ok := members[name]
		if !ok || string(r) == "null" {
			return false
		}
		if err := json.Unmarshal(r, v); err != nil {
			fail(field, fmt.Errorf("image metadata: %s: %w", name, err))
			return false
		}
		return true
	}
	var version int
	if member(FieldImage, "image", &version) && (version < 2 || version > Version) {
		if version > Version {
			fail(FieldImage, fmt.Errorf("image description version %d: this ptxmig reads up to %d (upgrade ptxmig)", version, Version))
		} else {
			fail(FieldImage, fmt.Errorf("image description version %d is not valid", version))
		}
		return d, d.err()
	}
	d.Legacy = version == 0
	// Members both layouts share.
	member(FieldBase, "kind", &d.Kind)
	member(FieldBase, "host", &d.Host)
	member(FieldBase, "kernel", &d.Kernel)
	member(FieldBase, "driver", &d.Driver)
	member(FieldBase, "cuda", &d.CUDA)
	member(FieldBase, "criu", &d.CRIU)
	member(FieldBase, "gpus", &d.GPUs)
	member(FieldBase, "visible_gpus", &d.Visible)
	member(FieldBase, "pid", &d.PID)
	member(FieldBase, "cmdline", &d.Cmdline)
	var extra map[string]string
	member(FieldLabels, "extra", &extra)
	if err := d.validateBase(); err != nil {
		fail(FieldBase, err)
	}
	if d.Legacy {
		d.decodeLegacy(extra, fail)
	} else {
		member(FieldBase, "comm", &d.Comm)
		member(FieldCRIU, "shell_job", &d.ShellJob)
		member(FieldCRIU, "tty", &d.TTY)
		member(FieldCRIU, "tcp_established", &d.TCPEstablished)
		member(FieldCRIU, "network_lock", &d.NetworkLock)
		member(FieldCRIU, "left_running", &d.LeftRunning)
		var tree []TreeProc
		if member(FieldTree, "tree", &tree) {
			d.setTree(tree, fail)
		}
		var v2 string
		var v1 map[string]string
		member(FieldCgroups, "cgroup", &v2)
		member(FieldCgroups, "cgroup_v1", &v1)
		d.setCgroups(v2, v1, fail)
		var files []hostreq.File
		if member(FieldHostFiles, "host_files", &files) {
			d.setHostFiles(files, nil, fail)
		}
		var carried []hostreq.Carried
		if member(FieldCarried, "carried", &carried) {
			d.setCarried(carried, nil, fail)
		}
		var dm []devmemEntry
		if member(FieldDevmem, "devmem", &dm) {
			if err := d.setDevmem(dm); err != nil {
				fail(FieldDevmem, err)
			}
		}
		if len(extra) > 0 {
			d.Labels = extra
		}
	}
	if len(d.Labels) > maxLabels {
		fail(FieldLabels, fmt.Errorf("image labels: %d of them", len(d.Labels)))
		d.Labels = nil
	}
	return d, d.err()
}

func (d *Description) err() error {
	if len(d.problems) == 0 {
		return nil
	}
	return &InvalidError{Problems: slices.Clone(d.problems)}
}

// validateBase checks the members both layouts share (the store bounds their strings).
func (d *Description) validateBase() error {
	if d.PID < 0 || d.PID >= MaxPID {
		return fmt.Errorf("image metadata: pid %d", d.PID)
	}
	if len(d.GPUs) > maxGPUs || len(d.Visible) > maxGPUs {
		return fmt.Errorf("image metadata: %d GPUs, %d visible", len(d.GPUs), len(d.Visible))
	}
	for _, g := range append(slices.Clone(d.GPUs), d.Visible...) {
		if g.Index < 0 {
			return fmt.Errorf("image metadata: gpu index %d", g.Index)
		}
	}
	return nil
}

// setTree validates a recorded tree and keeps it (not when invalid).
func (d *Description) setTree(t []TreeProc, fail func(string, error)) {
	if err := validTree(t, d.PID); err != nil {
		fail(FieldTree, err)
		return
	}
	d.Tree = t
}

func validTree(t []TreeProc, root int) error {
	if len(t) > maxTree {
		return fmt.Errorf("image process tree: %d processes", len(t))
	}
	if len(t) == 0 || t[0].PID != root {
		return fmt.Errorf("image process tree does not start at the image's pid %d", root)
	}
	seen := map[int]bool{}
	for i, p := range t {
		if p.PID <= 1 || p.PID >= MaxPID || p.PPID < 0 || p.PPID >= MaxPID || seen[p.PID] {
			return fmt.Errorf("image process tree: bad or repeated pid %d (ppid %d)", p.PID, p.PPID)
		}
		if i > 0 && !seen[p.PPID] {
			return fmt.Errorf("image process tree: pid %d's parent %d is not listed before it", p.PID, p.PPID)
		}
		if p.Cgroup != "" {
			if err := proc.ValidCgroupPath(p.Cgroup); err != nil {
				return fmt.Errorf("image process tree: pid %d: %w", p.PID, err)
			}
		}
		seen[p.PID] = true
	}
	return nil
}

// setCgroups validates the recorded cgroups and keeps them (neither when one is invalid).
func (d *Description) setCgroups(v2 string, v1 map[string]string, fail func(string, error)) {
	if v2 != "" {
		if err := proc.ValidCgroupPath(v2); err != nil {
			fail(FieldCgroups, fmt.Errorf("image cgroup: %w", err))
			return
		}
	}
	if len(v1) > maxCgroupsV1 {
		fail(FieldCgroups, fmt.Errorf("image cgroups (v1): %d hierarchies", len(v1)))
		return
	}
	for k, p := range v1 {
		if k == "" || len(k) > 256 || strings.ContainsAny(k, ":/\n") {
			fail(FieldCgroups, fmt.Errorf("image cgroups (v1): bad hierarchy %q", k))
			return
		}
		if err := proc.ValidCgroupPath(p); err != nil {
			fail(FieldCgroups, fmt.Errorf("image cgroups (v1): %s: %w", k, err))
			return
		}
	}
	d.Cgroup = v2
	if len(v1) > 0 {
		d.CgroupV1 = v1
	}
}

func (d *Description) setHostFiles(files []hostreq.File, err error, fail func(string, error)) {
	if err == nil {
		err = hostreq.ValidateFiles(files)
	}
	if err != nil {
		fail(FieldHostFiles, err)
		return
	}
	d.HostFiles, d.HostFilesRecorded = files, true
}

func (d *Description) setCarried(cs []hostreq.Carried, err error, fail func(string, error)) {
	if err == nil {
		err = hostreq.ValidateCarried(cs)
	}
	if err != nil {
		fail(FieldCarried, err)
		return
	}
	d.Carried = cs
}

// devmemEntry is one process whose owned memory an image holds.
type devmemEntry struct {
	PID      int    `json:"pid"`
	Instance string `json:"instance"` // 16 hex digits: the shim's instance
}

func (d *Description) setDevmem(es []devmemEntry) error {
	if len(es) > maxDevmem {
		return fmt.Errorf("image owned memory: %d processes", len(es))
	}
	m := map[int]string{}
	for _, e := range es {
		if e.PID <= 0 || e.PID >= MaxPID || !validInstance(e.Instance) || m[e.PID] != "" {
			return fmt.Errorf("image owned memory: bad or repeated process %d (instance %.40q)", e.PID, e.Instance)
		}
		m[e.PID] = e.Instance
	}
	if len(m) > 0 {
		d.Devmem = m
	}
	return nil
}

func validInstance(s string) bool {
	_, err := hex.DecodeString(s)
	return len(s) == 16 && err == nil && strings.ToLower(s) == s
}

// decodeLegacy reads the extra strings of the layout before version 2, with the checks the
// readers of that layout made.
func (d *Description) decodeLegacy(extra map[string]string, fail func(string, error)) {
	d.Comm = extra[ExtraComm]
	d.ShellJob = extra[ExtraShellJob] == "true"
	d.TTY = extra[ExtraTTY] == "true"
	d.TCPEstablished = extra[ExtraTCPEstablished] == "true"
	d.NetworkLock = extra[ExtraNetworkLock]
	d.LeftRunning = extra[ExtraLeftRunning] == "true"
	if s, ok := extra[ExtraTree]; ok {
		var t []TreeProc
		if err := json.Unmarshal([]byte(s), &t); err != nil {
			fail(FieldTree, fmt.Errorf("image process tree: %w", err))
		} else {
			d.setTree(t, fail)
		}
	}
	var v1 map[string]string
	if s, ok := extra[ExtraCgroupV1]; ok {
		if err := json.Unmarshal([]byte(s), &v1); err != nil {
			fail(FieldCgroups, fmt.Errorf("image cgroups (v1): %w", err))
		}
	}
	if d.Problem(FieldCgroups) == nil {
		d.setCgroups(extra[ExtraCgroup], v1, fail)
	}
	if s, ok := extra[ExtraHostFiles]; ok {
		files, err := hostreq.Parse(s)
		d.setHostFiles(files, err, fail)
	}
	if s, ok := extra[ExtraCarried]; ok {
		cs, err := hostreq.ParseCarried(s)
		d.setCarried(cs, err, fail)
	}
	// Lenient, as it always was: it only finds a previous image to reference chunks of.
	if dm := DecodeDevmemLegacy(extra[ExtraDevmem]); len(dm) > 0 {
		d.Devmem = dm
	}
	for k, v := range extra {
		if !slices.Contains(legacyKeys, k) {
			if d.Labels == nil {
				d.Labels = map[string]string{}
			}
			d.Labels[k] = v
		}
	}
}

// DecodeDevmemLegacy reads the legacy "devmem" value ("pid:instance …"), skipping what is not
// valid.
func DecodeDevmemLegacy(s string) map[int]string {
	m := map[int]string{}
	for _, f := range strings.Fields(s) {
		pid, inst, ok := strings.Cut(f, ":")
		n, err := strconv.Atoi(pid)
		if ok && err == nil && n > 0 && len(inst) == 16 && isHex(inst) {
			m[n] = inst
		}
	}
	return m
}

// EncodeDevmemLegacy renders pid → instance as the legacy "devmem" value.
func EncodeDevmemLegacy(m map[int]string) string {
	var parts []string
	for pid, inst := range m {
		parts = append(parts, strconv.Itoa(pid)+":"+inst)
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

func isHex(s string) bool {
	_, err := hex.DecodeString(s)
	return err == nil
}

// wire is a version 2 description as encoded: the members of the metadata object, in order.
type wire struct {
	Kind           string            `json:"kind,omitempty"`
	Host           string            `json:"host,omitempty"`
	Kernel         string            `json:"kernel,omitempty"`
	Driver         string            `json:"driver,omitempty"`
	CUDA           string            `json:"cuda,omitempty"`
	CRIU           string            `json:"criu,omitempty"`
	GPUs           []GPU             `json:"gpus,omitempty"`
	Visible        []GPU             `json:"visible_gpus,omitempty"`
	PID            int               `json:"pid,omitempty"`
	Cmdline        []string          `json:"cmdline,omitempty"`
	Image          int               `json:"image"`
	Comm           string            `json:"comm,omitempty"`
	Tree           []TreeProc        `json:"tree,omitempty"`
	Cgroup         string            `json:"cgroup,omitempty"`
	CgroupV1       map[string]string `json:"cgroup_v1,omitempty"`
	ShellJob       bool              `json:"shell_job,omitempty"`
	TTY            bool              `json:"tty,omitempty"`
	TCPEstablished bool              `json:"tcp_established,omitempty"`
	NetworkLock    string            `json:"network_lock,omitempty"`
	LeftRunning    bool              `json:"left_running,omitempty"`
	HostFiles      *[]hostreq.File   `json:"host_files,omitempty"`
	Carried        []hostreq.Carried `json:"carried,omitempty"`
	Devmem         []devmemEntry     `json:"devmem,omitempty"`
	Extra          map[string]string `json:"extra,omitempty"`
}

// Encode renders d as version 2 metadata (a Legacy description too: it is written in the current
// layout). It checks nothing: Decode does, when the image is read (a valid description decodes
// to the same).
func (d *Description) Encode() (store.Metadata, error) {
	w := wire{Kind: d.Kind, Host: d.Host, Kernel: d.Kernel, Driver: d.Driver, CUDA: d.CUDA, CRIU: d.CRIU,
		GPUs: d.GPUs, Visible: d.Visible, PID: d.PID, Cmdline: d.Cmdline, Image: Version, Comm: d.Comm,
		Tree: d.Tree, Cgroup: d.Cgroup, CgroupV1: d.CgroupV1, ShellJob: d.ShellJob, TTY: d.TTY,
		TCPEstablished: d.TCPEstablished, NetworkLock: d.NetworkLock, LeftRunning: d.LeftRunning,
		Carried: d.Carried, Extra: d.Labels}
	if d.HostFilesRecorded {
		files := d.HostFiles
		if files == nil {
			files = []hostreq.File{}
		}
		w.HostFiles = &files
	}
	for _, pid := range slices.Sorted(maps.Keys(d.Devmem)) {
		w.Devmem = append(w.Devmem, devmemEntry{PID: pid, Instance: d.Devmem[pid]})
	}
	b, err := json.Marshal(&w)
	if err != nil {
		return nil, fmt.Errorf("encode image description: %w", err)
	}
	return b, nil
}

// HostFilesFit reports whether files fit a manifest's metadata (the store bounds each string;
// the legacy layout recorded them as one string): a list that does not is left out, and restore
// reads CRIU's files.img instead.
func HostFilesFit(files []hostreq.File) bool {
	return len(hostreq.Encode(files)) <= store.MaxMetaString
}

// Fields renders the description as the key/value lines image inspect shows after the process
// tree and the host files: the legacy extra keys with their values as checkpoint wrote them,
// then the labels, sorted by key. Empty values are left out.
func (d *Description) Fields() [][2]string {
	kv := map[string]string{}
	set := func(k, v string) {
		if v != "" {
			kv[k] = v
		}
	}
	flag := func(k string, b bool) {
		if b {
			kv[k] = "true"
		}
	}
	for k, v := range d.Labels {
		set(k, v)
	}
	set(ExtraComm, d.Comm)
	flag(ExtraShellJob, d.ShellJob)
	flag(ExtraTTY, d.TTY)
	flag(ExtraTCPEstablished, d.TCPEstablished)
	set(ExtraNetworkLock, d.NetworkLock)
	flag(ExtraLeftRunning, d.LeftRunning)
	set(ExtraCgroup, d.Cgroup)
	if len(d.CgroupV1) > 0 {
		b, _ := json.Marshal(d.CgroupV1) // strings: cannot fail; keys sorted
		set(ExtraCgroupV1, string(b))
	}
	if len(d.Devmem) > 0 {
		set(ExtraDevmem, EncodeDevmemLegacy(d.Devmem))
	}
	keys := make([]string, 0, len(kv))
	for k := range kv {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([][2]string, len(keys))
	for i, k := range keys {
		out[i] = [2]string{k, kv[k]}
	}
	return out
}

// TreePIDs lists the pids of a tree; cudaOnly keeps the CUDA processes.
func TreePIDs(t []TreeProc, cudaOnly bool) []int {
	var out []int
	for _, p := range t {
		if !cudaOnly || p.CUDA {
			out = append(out, p.PID)
		}
	}
	return out
}

// TreeOf converts /proc stats into a tree record; cuda marks the CUDA processes.
func TreeOf(stats []proc.Stat, cuda map[int]bool) []TreeProc {
	out := make([]TreeProc, len(stats))
	for i, s := range stats {
		out[i] = TreeProc{PID: s.PID, PPID: s.PPID, Comm: s.Comm, CUDA: cuda[s.PID]}
	}
	if len(out) > 0 {
		out[0].PPID = 0 // the root's parent is outside the image
	}
	return out
}

// CgroupsV1 keeps a process's cgroup v1 entries by hierarchy (nil when it has none).
func CgroupsV1(es []proc.CgroupEntry) map[string]string {
	m := map[string]string{}
	for _, e := range es {
		if !e.V2() && e.Controllers != "" {
			m[e.Controllers] = e.Path
		}
	}
	if len(m) == 0 {
		return nil
	}
	return m
}

// ErrInvalid is matched by errors.Is for any *InvalidError.
var ErrInvalid = errors.New("invalid image description")

// Is makes errors.Is(err, ErrInvalid) true for an *InvalidError.
func (e *InvalidError) Is(target error) bool { return target == ErrInvalid }

// RootPID is the pid an image records for its root process (0: none, or unreadable): what
// recovery and a checkpoint interrupted after its store step compare with their own.
func RootPID(m *store.Manifest) int {
	d, _ := Read(m)
	return d.PID
}
