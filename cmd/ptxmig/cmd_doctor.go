package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ptxmig/ptxmig/internal/bytesize"
	"github.com/ptxmig/ptxmig/internal/criu"
	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/journal"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/probe"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/ptxas"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/store"
)

// selfTestBound bounds doctor's dump and restore of a test process (each CRIU: half of it).
const selfTestBound = 20 * time.Second

func init() {
	register(&cli.Command{
		Name:  "doctor",
		Usage: "check this host before the first checkpoint: root, CRIU, driver, GPUs, store, shim; says how to fix",
		Description: "Checks, one line each with ok, warn or fail and the fix: root and the capabilities CRIU needs;\n" +
			"CRIU's version (>= 4.0; >= 4.2 to dump TCP/UDP sockets on Linux >= 6.16) and `criu check`; a\n" +
			"real dump and restore of a sleeping test process in a scratch directory, bounded in time, which\n" +
			"proves CRIU works here (`criu check` passed where every dump hung) and says whether ptrace\n" +
			"hardware breakpoints fire; the NVIDIA driver and what it allows (checkpoint and\n" +
			"restore on the same GPUs need >= 570, restore onto another GPU, migrate and rebalance >= 580)\n" +
			"and its checkpoint API; the GPUs (MIG is not supported) and their persistence mode; the store\n" +
			"(location, symlink target, owner, mode, read-only, free space; a missing store is fine if its\n" +
			"parent exists: the first checkpoint creates it); the staging and failure-log directories;\n" +
			"libptxmig.so (for `ptxmig run`), ptxas and the shim's socket directory; operations a ptxmig\n" +
			"that died left interrupted (their journals, read only: `ptxmig recover` handles them); and\n" +
			"whether a kill of ptxmig's whole cgroup (a service stopped, an OOM group kill) would spare the\n" +
			"guardian that rolls an operation back (it starts in the cgroup /ptxmig.keep where it can).\n" +
			"Nothing else is created or changed: the test process and its scratch directory are removed.\n" +
			"Exits 1 when any check fails, 0 otherwise (warnings included). A host without an NVIDIA driver\n" +
			"can still checkpoint CPU processes: the GPU lines are warnings there.\n\n" +
			"Examples:\n" +
			"   ptxmig doctor\n" +
			"   ptxmig doctor --json\n" +
			"   ptxmig --store /data/ptxmig doctor",
		Flags:  []cli.Flag{socketDirFlag()},
		Action: doctorAction,
	})
}

// check is one line of doctor's report.
type check struct {
	Name    string `json:"name"`
	Status  string `json:"status"` // ok, warn, fail
	Message string `json:"message"`
	Fix     string `json:"fix,omitempty"`
}

// doctorReport is doctor's --json document.
type doctorReport struct {
	Checks []check `json:"checks"`
	OK     int     `json:"ok"`
	Warn   int     `json:"warn"`
	Fail   int     `json:"fail"`
}

// doctorProbes reads the host; tests replace it.
type doctorProbes struct {
	euid          func() int
	missingCaps   func() ([]probe.Capability, error)
	criu          func(ctx context.Context) (probe.CRIUInfo, error)
	criuCheck     func(ctx context.Context, bin string) error
	criuSelfTest  func(ctx context.Context, bin string) (*criu.SelfTest, error)
	kernel        func() string // uname -r
	driver        func() (string, error)
	checkpointAPI func() (cudaVersion string, err error)
	gpus          func() ([]probe.GPUState, error)
	storeInfo     func(dir string) (*store.DirInfo, error)
	storeCreate   func(dir string) error // store.CheckCreate
	dirFree       func(dir string) (free uint64, exists bool, err error)
	shim          func() (string, error)
	ptxas         func() (string, error)
	socketDir     func(dir string) error
	pending       func() ([]op.Recovered, error) // op.Pending
	session       func() (int, error)            // ptxmig's session id as /proc shows it
	keep          func() (string, bool)          // proc.KeepReport: do guardians survive a kill of ptxmig's cgroup
}

var doctorHost = doctorProbes{
	euid: os.Geteuid,
	session: func() (int, error) {
		st, err := proc.ReadStat(os.Getpid())
		return st.SID, err
	},
	missingCaps: func() ([]probe.Capability, error) { return probe.MissingCapabilities(probe.CRIUCapabilities) },
	criu:        probe.HaveCRIU,
	criuCheck:   criu.CheckKernel,
	criuSelfTest: func(ctx context.Context, bin string) (*criu.SelfTest, error) {
		ctx, cancel := context.WithTimeout(ctx, selfTestBound)
		defer cancel()
		return criu.RunSelfTest(ctx, bin, "", selfTestBound/2)
	},
	kernel: func() string { return op.ReadHostInfo(nil).Kernel },
	driver: probe.DriverVersion,
	checkpointAPI: func() (string, error) {
		d, err := cudackpt.Open()
		if err == nil {
			err = d.Init()
		}
		if err != nil {
			return "", err
		}
		return cudackpt.FormatVersion(d.Version), nil
	},
	gpus:        probe.GPUStates,
	storeInfo:   store.Inspect,
	storeCreate: store.CheckCreate,
	dirFree: func(dir string) (uint64, bool, error) {
		d, exists := dir, true
		for {
			if _, err := os.Stat(d); err == nil {
				break
			}
			exists = false
			if p := filepath.Dir(d); p != d {
				d = p
			} else {
				break
			}
		}
		free, err := op.FreeBytes(d)
		return free, exists, err
	},
	shim: func() (string, error) {
		exe, _ := os.Executable()
		return findShim(os.Getenv("PTXMIG_SHIM"), exe)
	},
	ptxas:     ptxas.Find,
	socketDir: checkSocketDir,
	pending:   op.Pending,
	keep:      proc.KeepReport,
}

func doctorAction(c *cli.Context) error {
	if err := argsExactly(c, 0); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(c.Context, 30*time.Second)
	defer cancel()
	rep := runDoctor(ctx, doctorHost, env(c).Store, c.String("socket-dir"))
	if !env(c).JSON {
		writeDoctor(env(c).Out, rep)
	}
	if rep.Fail > 0 {
		return withResult(fmt.Errorf("doctor: %d check(s) failed: %s", rep.Fail, failedNames(rep)), rep)
	}
	if env(c).JSON {
		return printJSON(c, rep)
	}
	return nil
}

func missing2names(cs []probe.Capability) []string {
	n := make([]string, len(cs))
	for i, c := range cs {
		n[i] = c.Name
	}
	return n
}

func failedNames(r doctorReport) string {
	var n []string
	for _, ch := range r.Checks {
		if ch.Status == "fail" {
			n = append(n, ch.Name)
		}
	}
	return strings.Join(n, ", ")
}

func writeDoctor(w io.Writer, r doctorReport) {
	for _, ch := range r.Checks {
		fmt.Fprintf(w, "%-5s %-17s %s\n", ch.Status, ch.Name, escLines(ch.Message))
		if ch.Fix != "" {
			fmt.Fprintf(w, "%-23s fix: %s\n", "", escLines(ch.Fix))
		}
	}
	verdict := "ready for the first checkpoint"
	switch {
	case r.Fail > 0:
		verdict = "fix the failures before the first checkpoint"
	case r.Warn > 0:
		verdict = "ready; the warnings limit what works"
	}
	fmt.Fprintf(w, "\n%d ok, %d warning(s), %d failure(s): %s\n", r.OK, r.Warn, r.Fail, verdict)
}

// runDoctor runs every check. It changes nothing on the host.
func runDoctor(ctx context.Context, p doctorProbes, storeDir, sockDir string) doctorReport {
	var r doctorReport
	add := func(name, status, msg, fix string) {
		r.Checks = append(r.Checks, check{Name: name, Status: status, Message: msg, Fix: fix})
		switch status {
		case "ok":
			r.OK++
		case "warn":
			r.Warn++
		default:
			r.Fail++
		}
	}
	root := p.euid() == 0

	// Privileges.
	if root {
		add("root", "ok", "running as root", "")
	} else {
		add("root", "fail", fmt.Sprintf("running as uid %d: checkpoint, restore and migrate read, freeze and recreate other processes", p.euid()),
			"run ptxmig as root (sudo ptxmig ...)")
	}
	missing, err := p.missingCaps()
	var required, optional []string
	for _, c := range missing {
		if c.Required {
			required = append(required, c.Name)
		} else {
			optional = append(optional, c.Name)
		}
	}
	const capFix = "run as root on the host, not in a container that drops them (or grant them: docker run --privileged)"
	switch {
	case err != nil:
		add("capabilities", "warn", "cannot read the effective capabilities: "+err.Error(), "")
	case len(required) > 0:
		add("capabilities", "fail", "missing "+strings.Join(missing2names(missing), ", ")+": CRIU cannot dump or restore without "+strings.Join(required, " and "), capFix)
	case len(optional) > 0:
		add("capabilities", "warn", "missing "+strings.Join(optional, ", ")+": CRIU may fail on trees that need them "+
			"(other users' files, network namespaces, TCP connections, resource limits)", capFix)
	default:
		add("capabilities", "ok", "every capability CRIU uses is effective", "")
	}

	// Session: /proc shows 0 when its leader is outside this PID namespace (docker exec without a
	// terminal), and CRIU cannot dump a process of such a session.
	switch sid, err := p.session(); {
	case err != nil:
		add("session", "warn", "cannot read ptxmig's session: "+err.Error(), "")
	case sid == 0:
		add("session", "warn", "this session's leader is outside this PID namespace (as under docker exec without -t): "+
			"CRIU cannot checkpoint a process started plainly from here", "start jobs with `ptxmig run` (it gives them a session of their own) or setsid")
	default:
		add("session", "ok", fmt.Sprintf("session %d: processes started from here can be checkpointed", sid), "")
	}

	// CRIU.
	const criuFix = "scripts/install-criu.sh builds CRIU 4.2.1 (or set PTXMIG_CRIU to a CRIU >= 4.2)"
	ci, err := p.criu(ctx)
	switch {
	case errors.Is(err, probe.ErrNotSupported):
		add("criu", "fail", fmt.Sprintf("%s at %s: %v", ci.Version, ci.Path, err), criuFix)
	case err != nil:
		add("criu", "fail", err.Error(), criuFix)
	case probe.PassCredRestricted(p.kernel()) && probe.CRIUSockets.Check(ci.Version) != nil:
		add("criu", "warn", fmt.Sprintf("%s (%s) on Linux %s: %v; such a dump fails (and rolls back)", ci.Version, ci.Path, p.kernel(),
			probe.CRIUSockets.Check(ci.Version)), criuFix)
	default:
		add("criu", "ok", fmt.Sprintf("%s (%s)", ci.Version, ci.Path), "")
	}
	switch {
	case err != nil:
		add("criu check", "warn", "skipped: no usable CRIU", "")
		add("criu self-test", "warn", "skipped: no usable CRIU", "")
	case !root:
		add("criu check", "warn", "skipped: `criu check` needs root", "run ptxmig doctor as root")
		add("criu self-test", "warn", "skipped: a dump and restore need root", "run ptxmig doctor as root")
	default:
		if cerr := p.criuCheck(ctx, ci.Path); cerr != nil {
			add("criu check", "fail", cerr.Error(), "run `criu check --all` for details; CRIU needs a kernel with CONFIG_CHECKPOINT_RESTORE and friends")
		} else {
			add("criu check", "ok", "the kernel has what CRIU needs", "")
		}
		// `criu check` said "Looks good" on a VM where every dump hung: only a dump proves it.
		st, serr := p.criuSelfTest(ctx, ci.Path)
		var bp criu.Breakpoints
		if st != nil {
			bp = st.Breakpoints
		}
		note := map[criu.Breakpoints]string{
			criu.BreakpointsWork:    "hardware breakpoints work",
			criu.BreakpointsBroken:  "hardware breakpoints do not fire here (CRIU traps without them)",
			criu.BreakpointsUnknown: "this CRIU cannot tell whether hardware breakpoints fire",
		}[bp]
		switch {
		case serr != nil && bp == criu.BreakpointsBroken:
			add("criu self-test", "fail", fmt.Sprintf("%v; hardware breakpoints do not fire here", serr),
				"CRIU < 4.2 hangs where ptrace hardware breakpoints do not fire: "+criuFix)
		case serr != nil:
			add("criu self-test", "fail", serr.Error(), "read the CRIU log named above; "+criuFix)
		default:
			add("criu self-test", "ok", fmt.Sprintf("dumped and restored a test process (%s, %s); %s", ms(st.Dump), ms(st.Restore), note), "")
		}
	}

	// NVIDIA driver, its checkpoint API, GPUs.
	dv, derr := p.driver()
	switch {
	case derr != nil:
		add("nvidia driver", "warn", "none ("+derr.Error()+"): only processes that use no GPU can be checkpointed",
			fmt.Sprintf("install NVIDIA driver >= %s (>= %s for checkpoints only)", probe.DriverGPURemap.Minimum, probe.DriverCheckpoint.Minimum))
	case probe.DriverCheckpoint.Check(dv) != nil:
		add("nvidia driver", "fail", fmt.Sprintf("%s: %v", dv, probe.DriverCheckpoint.Check(dv)),
			fmt.Sprintf("upgrade the NVIDIA driver to >= %s", probe.DriverGPURemap.Minimum))
	case probe.DriverGPURemap.Check(dv) != nil:
		add("nvidia driver", "warn", fmt.Sprintf("%s: checkpoint and restore onto the same GPUs only; %v", dv, probe.DriverGPURemap.Check(dv)),
			fmt.Sprintf("upgrade the NVIDIA driver to >= %s", probe.DriverGPURemap.Minimum))
	default:
		add("nvidia driver", "ok", dv+": checkpoint and restore, also onto other GPUs (migrate, rebalance)", "")
	}
	if derr == nil {
		switch cuda, err := p.checkpointAPI(); {
		case errors.Is(err, cudackpt.ErrNotSupported):
			add("checkpoint api", "fail", err.Error(), fmt.Sprintf("upgrade the NVIDIA driver to >= %s", probe.DriverGPURemap.Minimum))
		case errors.Is(err, cudackpt.ErrNoDriver):
			add("checkpoint api", "fail", err.Error(), "check that libcuda.so.1 of the same driver is installed (or set PTXMIG_LIBCUDA)")
		case err != nil:
			add("checkpoint api", "fail", err.Error(), "")
		default:
			add("checkpoint api", "ok", "libcuda.so.1 has the process checkpoint API (CUDA "+cuda+")", "")
		}
	}
	if derr == nil {
		gs, err := p.gpus()
		switch {
		case err != nil:
			add("gpus", "warn", "cannot list GPUs: "+err.Error(), "")
		case len(gs) == 0:
			add("gpus", "warn", "the driver sees no GPU", "")
		default:
			var list, mig, off, unknown []string
			for _, g := range gs {
				list = append(list, fmt.Sprintf("%d %s (sm %s)", g.Index, g.Name, g.ComputeCap))
				if g.MIG {
					mig = append(mig, fmt.Sprint(g.Index))
				}
				switch {
				case g.Persistence == nil:
					unknown = append(unknown, fmt.Sprint(g.Index))
				case !*g.Persistence:
					off = append(off, fmt.Sprint(g.Index))
				}
			}
			if len(mig) > 0 {
				add("gpus", "warn", fmt.Sprintf("%d: %s; MIG is enabled on GPU %s, which ptxmig does not support", len(gs), strings.Join(list, ", "), strings.Join(mig, ", ")),
					"nvidia-smi -i N -mig 0 on the GPUs whose processes are to be checkpointed")
			} else {
				add("gpus", "ok", fmt.Sprintf("%d: %s", len(gs), strings.Join(list, ", ")), "")
			}
			switch {
			case len(off) > 0:
				add("persistence mode", "warn", "off on GPU "+strings.Join(off, ", ")+": the driver tears a GPU's state down whenever no process holds it "+
					"(e.g. between a checkpoint and its restore), and the restore waits for it to come up again", "nvidia-smi -pm 1, or run nvidia-persistenced")
			case len(unknown) > 0:
				add("persistence mode", "warn", "NVML does not report it for GPU "+strings.Join(unknown, ", "), "")
			default:
				add("persistence mode", "ok", "on for every GPU", "")
			}
		}
	}
	// Store, staging, logs.
	storeCheck(p, storeDir, add)
	staging := os.Getenv("PTXMIG_STAGING_DIR")
	roots := []string{op.StagingTmpfs, op.StagingDisk}
	if staging != "" {
		roots = []string{staging}
	}
	var parts []string
	for _, d := range roots {
		free, exists, err := p.dirFree(d)
		if err != nil {
			add("staging", "warn", fmt.Sprintf("%s: %v", d, err), "")
			continue
		}
		note := ""
		if !exists {
			note = ", created when first used"
		}
		parts = append(parts, fmt.Sprintf("%s (%s free%s)", d, bytesize.FormatU(free), note))
	}
	if len(parts) > 0 {
		add("staging", "ok", "CRIU's images go to "+strings.Join(parts, " or ")+"; $PTXMIG_STAGING_DIR overrides", "")
	}
	logDir := op.LogDir()
	if _, exists, err := p.dirFree(logDir); err != nil {
		add("failure logs", "warn", fmt.Sprintf("%s: %v", logDir, err), "")
	} else if exists {
		add("failure logs", "ok", logDir+" (kept on failures; `ptxmig image gc` prunes; $PTXMIG_LOG_DIR overrides)", "")
	} else {
		add("failure logs", "ok", logDir+" (created on the first failure; $PTXMIG_LOG_DIR overrides)", "")
	}
	pendingCheck(p, root, add) // operations a ptxmig that died left behind
	if msg, ok := p.keep(); ok {
		add("group kill", "ok", msg, "")
	} else {
		add("group kill", "warn", msg, "units that run ptxmig: name ptxmig-recover.service in OnFailure= (ptxmig-rebalance.service does), so that a kill of the unit's cgroup is rolled back")
	}

	// The shim and its tools.
	if s, err := p.shim(); err != nil {
		add("shim", "warn", err.Error()+": `ptxmig run` (kernel statistics, preemptible long kernels) needs it",
			"make install puts it in /usr/local/lib (or pass ptxmig run --shim PATH, or set PTXMIG_SHIM)")
	} else {
		add("shim", "ok", s, "")
	}
	if s, err := p.ptxas(); err != nil {
		add("ptxas", "warn", err.Error()+": checkpoints do not need it; without it the preemptible twins `ptxmig run` loads keep no register cap (some then fit fewer CTAs per SM and launch as originals), instrumented modules load as PTX the driver compiles at every start, and the test suite cannot check instrumented PTX",
			"scripts/install-ptxas.sh (or set PTXAS)")
	} else {
		add("ptxas", "ok", s, "")
	}
	sd := shimctl.SocketDir(sockDir)
	if err := p.socketDir(sd); err != nil {
		add("socket directory", "warn", strings.TrimPrefix(err.Error(), "run: "), "")
	} else {
		add("socket directory", "ok", sd+": the shim can create its control sockets there", "")
	}
	return r
}

// pendingCheck reports operations that a ptxmig which died left interrupted (op.Pending: the
// journals are only read), which `ptxmig recover` rolls back or finishes.
func pendingCheck(p doctorProbes, root bool, add func(name, status, msg, fix string)) {
	const name, fix = "interrupted ops", "ptxmig recover"
	dir := journal.Dir()
	if !root {
		add(name, "warn", "skipped: the operation journals in "+dir+" are root's", "run ptxmig doctor as root")
		return
	}
	ops, err := p.pending()
	if err != nil {
		add(name, "warn", "cannot read the operation journals: "+err.Error(), "")
		return
	}
	if len(ops) == 0 {
		add(name, "ok", "none: no operation was left behind by a ptxmig that died (journals in "+dir+")", "")
		return
	}
	var list []string
	for _, r := range ops {
		what := "journal " + r.Journal
		if r.Op != "" {
			what = fmt.Sprintf("%s of pid %d (journal %s, started %s)", r.Op, r.PID, r.Journal, r.Started.Local().Format("2006-01-02 15:04:05"))
		}
		switch r.Outcome {
		case op.RecoveredBusy:
			what += ": its guardian is rolling it back"
		case op.RecoveredRefused:
			what += ": invalid (" + r.Error + "); recover keeps it aside and touches no process"
		}
		list = append(list, what)
	}
	add(name, "warn", fmt.Sprintf("%d operation(s) left by a ptxmig that died: %s. Until recovered, their processes may stay "+
		"stopped or their GPUs locked, and staging space stays taken", len(ops), strings.Join(list, "; ")), fix)
}

// storeCheck reports on the store directory with the store's own checks, changing nothing.
func storeCheck(p doctorProbes, dir string, add func(name, status, msg, fix string)) {
	info, err := p.storeInfo(dir)
	where := info.Dir
	if info.Resolved != "" {
		where += " -> " + info.Resolved
	}
	free := bytesize.FormatU(info.FreeBytes) + " free"
	switch {
	case errors.Is(err, store.ErrInsecure):
		add("store", "fail", err.Error(), fmt.Sprintf("chown root %s && chmod 700 %s (or point --store elsewhere)", info.Dir, info.Dir))
	case !info.Exists && errors.Is(err, store.ErrNoStore) && p.storeCreate(dir) == nil:
		add("store", "ok", fmt.Sprintf("%s does not exist yet: the first checkpoint creates it (%s)", where, free), "")
	case !info.Exists:
		add("store", "fail", err.Error(), fmt.Sprintf("mkdir -p %s, or point --store (or $PTXMIG_STORE) at the right place", filepath.Dir(info.Dir)))
	case err != nil && errors.Is(err, store.ErrNoStore):
		msg := fmt.Sprintf("%s holds no store yet", where)
		if cerr := p.storeCreate(dir); cerr != nil {
			add("store", "fail", cerr.Error(), "point --store at an empty or new directory")
		} else {
			add("store", "ok", msg+": the first checkpoint creates it ("+free+")", "")
		}
	case err != nil:
		add("store", "fail", err.Error(), "")
	case info.ReadOnly:
		add("store", "warn", fmt.Sprintf("%s: read-only (owner uid %d, mode %04o, %s): restore and the image commands that read work; checkpoints cannot write",
			where, info.UID, info.Mode.Perm(), free), "")
	default:
		status, fix := "ok", ""
		if info.FreeBytes < 10<<30 {
			status, fix = "warn", "free space: an image needs up to the process's resident memory plus its GPU memory"
		}
		add("store", status, fmt.Sprintf("%s: owner uid %d, mode %04o, %s", where, info.UID, info.Mode.Perm(), free), fix)
	}
}
