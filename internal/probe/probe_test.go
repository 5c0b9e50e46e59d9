package probe

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ptxmig/ptxmig/internal/criu"
)

func TestFeatureCheck(t *testing.T) {
	tests := []struct {
		f       Feature
		version string
		want    error // nil, ErrNotSupported, or any other error (errParse)
	}{
		{DriverCheckpoint, "570.86.15", nil},
		{DriverCheckpoint, "580.95.05", nil},
		{DriverCheckpoint, "565.57.01", ErrNotSupported},
		{DriverGPURemap, "575.51.03", ErrNotSupported},
		{DriverGPURemap, "580", nil},
		{DriverGPURemap, "1000.1", nil},
		{CRIU, "3.17.1", ErrNotSupported},
		{CRIU, "4.0", nil},
		{CRIU, "4.1.1", nil},
		{CRIU, "garbage", errParse},
		{CRIUSockets, "4.1.1", ErrNotSupported},
		{CRIUSockets, "4.2", nil},
		{CRIUSockets, "4.2.1", nil},
	}
	for _, tt := range tests {
		err := tt.f.Check(tt.version)
		switch {
		case tt.want == nil && err != nil, tt.want == ErrNotSupported && !errors.Is(err, ErrNotSupported),
			tt.want == errParse && (err == nil || errors.Is(err, ErrNotSupported)):
			t.Errorf("%s.Check(%q) = %v, want %v", tt.f.Component, tt.version, err, tt.want)
		}
		var ufe *UnsupportedFeatureError
		if errors.As(err, &ufe) && (ufe.MinimumVersion != tt.f.Minimum || ufe.Found != tt.version || !strings.Contains(err.Error(), ">= "+tt.f.Minimum)) {
			t.Errorf("%s.Check(%q): %+v", tt.f.Component, tt.version, ufe)
		}
	}
}

var errParse = errors.New("parse")

func TestPassCredRestricted(t *testing.T) {
	for release, want := range map[string]bool{
		"6.18.44-fc-v769": true, "6.16.0": true, "6.16": true, "7.0.1": true,
		"6.15.9-arch1": false, "6.1.0-28-amd64": false, "5.15.0": false, "weird": false,
	} {
		if got := PassCredRestricted(release); got != want {
			t.Errorf("PassCredRestricted(%q) = %v, want %v", release, got, want)
		}
	}
}

func TestVersionLess(t *testing.T) {
	for _, tt := range []struct {
		a, b string
		less bool
	}{{"580", "580.0.0", false}, {"570.1", "580", true}, {"4.0", "4", false}, {"3.17.1", "4.0", true}, {"10.0", "9.9", false}} {
		a, _ := ParseVersion(tt.a)
		b, _ := ParseVersion(tt.b)
		if a.Less(b) != tt.less {
			t.Errorf("%s < %s: %v, want %v", tt.a, tt.b, a.Less(b), tt.less)
		}
	}
}

// TestHostProbes: the driver probes read the version once and apply the features' rules; no
// driver at all is not "not supported" but an error of its own.
func TestHostProbes(t *testing.T) {
	defer func(f func() (string, error)) { readDriverVersion = f }(readDriverVersion)
	readDriverVersion = func() (string, error) { return "575.51.03", nil }
	driverOnce = onceDriver()
	if err := HaveDriverCheckpoint(); err != nil {
		t.Errorf("575: checkpoint: %v", err)
	}
	if err := HaveGPURemap(); !errors.Is(err, ErrNotSupported) {
		t.Errorf("575: remap: %v, want ErrNotSupported", err)
	}
	noDriver := errors.New("no NVIDIA driver")
	readDriverVersion = func() (string, error) { return "", noDriver }
	driverOnce = onceDriver()
	if err := HaveDriverCheckpoint(); !errors.Is(err, noDriver) || errors.Is(err, ErrNotSupported) {
		t.Errorf("no driver: %v", err)
	}

	defer func(f func(context.Context) (string, string, error)) { criuProbe = f }(criuProbe)
	criuProbe = func(context.Context) (string, string, error) {
		return "/usr/sbin/criu", "3.17.1", criu.ErrTooOld
	}
	if _, err := HaveCRIU(context.Background()); !errors.Is(err, ErrNotSupported) {
		t.Errorf("old criu: %v", err)
	}
	criuProbe = func(context.Context) (string, string, error) { return "", "", criu.ErrNotFound }
	if _, err := HaveCRIU(context.Background()); !errors.Is(err, criu.ErrNotFound) || errors.Is(err, ErrNotSupported) {
		t.Errorf("no criu: %v", err)
	}
}

func TestEffectiveCaps(t *testing.T) {
	p := filepath.Join(t.TempDir(), "status")
	os.WriteFile(p, []byte("Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t00000000a80425fb\n"), 0o644)
	eff, err := effectiveCaps(p)
	if err != nil || eff != 0xa80425fb {
		t.Fatalf("effectiveCaps = %x, %v", eff, err)
	}
	// Docker's default set lacks CAP_SYS_ADMIN (21) and CAP_SYS_PTRACE (19).
	if eff&(1<<21) != 0 || eff&(1<<19) != 0 || eff&(1<<0) == 0 {
		t.Errorf("bits of %x", eff)
	}
	if _, err := MissingCapabilities(CRIUCapabilities); err != nil {
		t.Errorf("MissingCapabilities on this host: %v", err)
	}
}

func TestDriverVersionFromProc(t *testing.T) {
	for _, line := range []string{
		"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16-A24-12-3)  Thu Sep 18 2025",
		"NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Fri Jan 24 2025",
	} {
		m := nvrmRE.FindStringSubmatch(line)
		if m == nil || (m[1] != "580.95.05" && m[1] != "570.86.15") {
			t.Errorf("%q: %v", line, m)
		}
	}
}
