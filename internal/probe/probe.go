// Package probe answers "can this host do X?" before ptxmig tries X, in the style of cilium/ebpf's
// features package: a probe returns nil when the feature is there; an error wrapping
// ErrNotSupported, an *UnsupportedFeatureError naming the component and its minimum version, when
// the host has the component but too old a version of it; and any other error when the probe
// itself could not tell (no NVIDIA driver at all, CRIU not found, /proc unreadable).
//
// Version rules are pure (Feature.Check) so that checkpoint/restore preflight, `ptxmig doctor` and
// tests apply the same ones; the host probes (HaveDriverCheckpoint, HaveGPURemap, HaveCRIU) read
// the host once per process and remember the answer.
package probe

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/gpu"
)

// ErrNotSupported: the host's component is too old (or lacks the interface) for the feature.
var ErrNotSupported = errors.New("not supported")

// UnsupportedFeatureError says which component must be at which version for a feature.
type UnsupportedFeatureError struct {
	Feature        string // "restore onto another GPU"
	Component      string // "NVIDIA driver"
	MinimumVersion string // "580"
	Found          string // the version found; "" when the component lacks the interface
}

func (e *UnsupportedFeatureError) Error() string {
	found := e.Found
	if found == "" {
		found = "a version without it"
	}
	return fmt.Sprintf("%s needs %s >= %s (found %s)", e.Feature, e.Component, e.MinimumVersion, found)
}

// Is makes errors.Is(err, ErrNotSupported) true.
func (e *UnsupportedFeatureError) Is(target error) bool { return target == ErrNotSupported }

// Feature is a capability that needs a minimum version of one component.
type Feature struct {
	Name      string
	Component string
	Minimum   string
}

// The features ptxmig's operations need.
var (
	// DriverCheckpoint: cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock} (driver r570), enough
	// to checkpoint a CUDA process and restore it onto the GPUs it ran on.
	DriverCheckpoint = Feature{Name: "checkpoint and restore of CUDA processes", Component: "NVIDIA driver", Minimum: "570"}
	// DriverGPURemap: restore with GPU pairs (CU_CHECKPOINT_RESTORE_ARGS gpuPairs, driver r580):
	// restore onto other GPUs, migrate, rebalance.
	DriverGPURemap = Feature{Name: "restore onto another GPU (GPU pairs: restore --gpu, migrate, rebalance)", Component: "NVIDIA driver", Minimum: "580"}
	// CRIU: ptxmig drives CRIU >= 4.0 over its RPC (older CRIU fails on current kernels).
	CRIU = Feature{Name: "checkpoint and restore of process trees", Component: "CRIU", Minimum: "4.0"}
	// CRIUSockets: Linux 6.16 allows SO_PASSCRED/SO_PASSSEC on unix and netlink sockets only, and
	// CRIU < 4.2 reads them on every socket, so it cannot dump a process with a TCP or UDP socket
	// there ("Can't get 1:16 opt", measured 2026-11-28 with 4.1.1 on kernel 6.18).
	CRIUSockets = Feature{Name: "checkpoint of processes with TCP or UDP sockets on Linux >= 6.16", Component: "CRIU", Minimum: "4.2"}
)

// PassCredRestricted reports whether the kernel release (uname -r) is Linux >= 6.16, where
// CRIUSockets applies. A release that does not parse is not.
func PassCredRestricted(release string) bool {
	v, err := ParseVersion(release)
	return err == nil && !v.Less(Version{6, 16})
}

// Check reports whether version (of f.Component) provides f: nil, or an *UnsupportedFeatureError.
// A version that does not parse is an error of its own (not ErrNotSupported).
func (f Feature) Check(version string) error {
	have, err := ParseVersion(version)
	if err != nil {
		return fmt.Errorf("%s version %q: %w", f.Component, version, err)
	}
	want, err := ParseVersion(f.Minimum)
	if err != nil {
		return err
	}
	if have.Less(want) {
		return &UnsupportedFeatureError{Feature: f.Name, Component: f.Component, MinimumVersion: f.Minimum, Found: version}
	}
	return nil
}

// Version is a dotted numeric version: 580.95.05 is {580, 95, 5}.
type Version []int

var versionRE = regexp.MustCompile(`^\d+(\.\d+)*`)

// ParseVersion reads the leading dotted number of s ("580.95.05", "4.1.1", "570").
func ParseVersion(s string) (Version, error) {
	m := versionRE.FindString(strings.TrimSpace(s))
	if m == "" {
		return nil, fmt.Errorf("not a version: %q", s)
	}
	var v Version
	for _, p := range strings.Split(m, ".") {
		n, err := strconv.Atoi(p)
		if err != nil {
			return nil, fmt.Errorf("not a version: %q", s)
		}
		v = append(v, n)
	}
	return v, nil
}

// Less compares component by component; a missing component counts as 0.
func (v Version) Less(o Version) bool {
	for i := range max(len(v), len(o)) {
		a, b := 0, 0
		if i < len(v) {
			a = v[i]
		}
		if i < len(o) {
			b = o[i]
		}
		if a != b {
			return a < b
		}
	}
	return false
}

// readDriverVersion reads the host's driver version; replaceable in tests.
var readDriverVersion = hostDriverVersion

// procDriverVersion is where the kernel module states its version, readable without NVML.
const procDriverVersion = "/proc/driver/nvidia/version"

var nvrmRE = regexp.MustCompile(`Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)`)

// hostDriverVersion reads the NVIDIA driver version: NVML, else the kernel module's /proc file.
func hostDriverVersion() (string, error) {
	if d, err := gpu.ReadDriverInfo(); err == nil {
		return d.Driver, nil
	} else if b, perr := os.ReadFile(procDriverVersion); perr == nil {
		if m := nvrmRE.FindSubmatch(b); m != nil {
			return string(m[1]), nil
		}
		return "", fmt.Errorf("%s: no version in %q", procDriverVersion, firstLine(string(b)))
	} else {
		return "", err
	}
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}

var driverOnce = onceDriver()

func onceDriver() func() (string, error) {
	return sync.OnceValues(func() (string, error) { return readDriverVersion() })
}

// DriverVersion is the host's NVIDIA driver version ("580.95.05"), read once. Without a driver the
// error wraps gpu.ErrNoDriver.
func DriverVersion() (string, error) { return driverOnce() }

// HaveDriverCheckpoint: the driver can checkpoint CUDA processes and restore them onto their GPUs.
func HaveDriverCheckpoint() error { return haveDriver(DriverCheckpoint) }

// HaveGPURemap: the driver can restore a CUDA process onto other GPUs.
func HaveGPURemap() error { return haveDriver(DriverGPURemap) }

func haveDriver(f Feature) error {
	v, err := DriverVersion()
	if err != nil {
		return fmt.Errorf("%s: %w", f.Name, err)
	}
	return f.Check(v)
}

// CRIUInfo is what HaveCRIU found.
type CRIUInfo struct {
	Path    string
	Version string
}

var criuProbe = func(ctx context.Context) (string, string, error) { return criu.Check(ctx) }

// HaveCRIU finds CRIU and checks its version: nil with the binary and version, an
// *UnsupportedFeatureError (ErrNotSupported) for an old one, or criu.ErrNotFound.
func HaveCRIU(ctx context.Context) (CRIUInfo, error) {
	path, text, err := criuProbe(ctx)
	info := CRIUInfo{Path: path, Version: text}
	switch {
	case errors.Is(err, criu.ErrTooOld):
		return info, &UnsupportedFeatureError{Feature: CRIU.Name, Component: CRIU.Component, MinimumVersion: CRIU.Minimum, Found: text}
	case err != nil:
		return info, err
	}
	return info, CRIU.Check(text)
}
