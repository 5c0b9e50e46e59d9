package main

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/gpu"
)

func init() {
	register(&cli.Command{
		Name:  "version",
		Usage: "print ptxmig's version and the NVIDIA driver, CUDA and CRIU versions found",
		Description: "`ptxmig --version` prints ptxmig's own version only; `ptxmig doctor` checks everything a\n" +
			"checkpoint needs and says how to fix what is missing.\n\n" +
			"Examples:\n" +
			"   ptxmig version\n" +
			"   ptxmig version --json",
		Action: versionAction,
	})
}

// versionInfo is the --json form of `ptxmig version`. Absent components carry an explanation.
type versionInfo struct {
	Ptxmig    string `json:"ptxmig"`
	Go        string `json:"go"`
	Driver    string `json:"driver,omitempty"`
	CUDA      string `json:"cuda,omitempty"`
	DriverErr string `json:"driver_error,omitempty"`
	CRIU      string `json:"criu,omitempty"`
	CRIUPath  string `json:"criu_path,omitempty"`
	CRIUErr   string `json:"criu_error,omitempty"`
}

// Probes, replaceable in tests so golden output does not depend on the host.
var (
	probeDriver = gpu.ReadDriverInfo
	probeCRIU   = func(ctx context.Context) (string, string, error) { return criu.Check(ctx) }
)

func versionAction(c *cli.Context) error {
	if err := argsExactly(c, 0); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(c.Context, 10*time.Second)
	defer cancel()
	v := versionInfo{Ptxmig: version, Go: runtime.Version()}
	if d, err := probeDriver(); err != nil {
		v.DriverErr = err.Error()
	} else {
		v.Driver, v.CUDA = d.Driver, d.CUDA
	}
	if path, text, err := probeCRIU(ctx); err != nil {
		v.CRIUErr = err.Error()
		v.CRIUPath = path
	} else {
		v.CRIU, v.CRIUPath = text, path
	}
	if env(c).JSON {
		return printJSON(c, v)
	}
	w := env(c).Out
	fmt.Fprintf(w, "ptxmig  %s (%s)\n", v.Ptxmig, v.Go)
	if v.DriverErr != "" {
		fmt.Fprintf(w, "driver  not available: %s\n", esc(v.DriverErr))
	} else {
		fmt.Fprintf(w, "driver  %s (CUDA %s)\n", v.Driver, v.CUDA)
	}
	if v.CRIUErr != "" {
		fmt.Fprintf(w, "criu    not usable: %s\n", esc(v.CRIUErr))
	} else {
		fmt.Fprintf(w, "criu    %s (%s)\n", v.CRIU, v.CRIUPath)
	}
	return nil
}

func goVersion() string { return runtime.Version() }
