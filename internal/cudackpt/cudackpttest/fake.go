// Package cudackpttest is a fake NVIDIA driver checkpoint API for tests of checkpoint, restore
// and migrate without a GPU: it models the driver's per-process state machine (running → locked
// → checkpointed → locked → running), which GPU each process is on, driver 580's rule that
// restore pairs must pair every visible GPU one to one, and injected failures.
package cudackpttest

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/ptxmig/ptxmig/internal/cudackpt"
	"github.com/ptxmig/ptxmig/internal/proc"
	"github.com/ptxmig/ptxmig/internal/testproc"
)

// ErrInvalidValue is what driver 580 answers to pairs that are not a bijection over the
// visible GPUs.
var ErrInvalidValue = errors.New("CUDA_ERROR_INVALID_VALUE (1): invalid argument")

// Proc is one process as the fake driver sees it.
type Proc struct {
	State cudackpt.State
	GPU   string // UUID of the GPU it runs on
	// UVM, when set, makes the process a real one that stands for a CUDA process whose threads
	// touch the driver's mappings (testproc's --uvm FILE): the fake names its main thread as the
	// restore thread, truncates UVM at the checkpoint and gives it back its testproc.UVMSize bytes at the
	// restore, so a thread of it that runs in between dies of SIGBUS.
	UVM string
	// Real marks a real process (UVM set implies it): the fake names its main thread as the
	// restore thread, so ptxmig holds its other threads around the checkpoint and restore as it
	// does with the driver. A pretend pid (or the test process itself) must not be Real.
	Real bool
}

// Driver is the fake. Calls are recorded by name ("lock", "checkpoint", "restore",
// "restore-to-UUID" for a restore with pairs, "unlock"), and with their pid in PIDCalls
// ("lock 42"). FailNext maps a call name, or "name pid", to an error returned once.
type Driver struct {
	mu       sync.Mutex
	Procs    map[int]*Proc
	Visible  []string // UUIDs; nil: pairs are not checked
	Calls    []string
	PIDCalls []string
	FailNext map[string]error
}

// New returns a fake with each pid running on gpu.
func New(gpu string, visible []string, pids ...int) *Driver {
	d := &Driver{Procs: map[int]*Proc{}, Visible: visible, FailNext: map[string]error{}}
	for _, p := range pids {
		d.Procs[p] = &Proc{State: cudackpt.Running, GPU: gpu}
	}
	return d
}

// stopped is an error matching cudackpt.ErrStopped when p is a real process whose restore thread
// (its main thread) is stopped: the driver's calls about it would never return.
func (p *Proc) stopped(pid int) error {
	if (p.Real || p.UVM != "") && proc.ThreadStopped(pid, pid) {
		return fmt.Errorf("pid %d: %w", pid, cudackpt.ErrStopped)
	}
	return nil
}

// NewReal is New for real processes (Proc.Real): ptxmig holds their threads as with the driver.
func NewReal(gpu string, visible []string, pids ...int) *Driver {
	d := New(gpu, visible, pids...)
	for _, p := range d.Procs {
		p.Real = true
	}
	return d
}

// Get returns a copy of pid's state (the zero Proc when unknown).
func (d *Driver) Get(pid int) Proc {
	d.mu.Lock()
	defer d.mu.Unlock()
	if p, ok := d.Procs[pid]; ok {
		return *p
	}
	return Proc{}
}

func (d *Driver) call(name string, pid int) (*Proc, error) {
	d.Calls = append(d.Calls, name)
	d.PIDCalls = append(d.PIDCalls, fmt.Sprintf("%s %d", name, pid))
	p, ok := d.Procs[pid]
	if !ok {
		return nil, cudackpt.ErrNotCUDA
	}
	if err := p.stopped(pid); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err) // the driver's call would never return
	}
	for _, k := range []string{fmt.Sprintf("%s %d", name, pid), name} {
		if err, ok := d.FailNext[k]; ok {
			delete(d.FailNext, k)
			return p, err
		}
	}
	return p, nil
}

func (d *Driver) checkPairs(pairs []cudackpt.Pair) error {
	if len(pairs) == 0 || d.Visible == nil {
		return nil
	}
	olds, news := map[string]bool{}, map[string]bool{}
	for _, p := range pairs {
		olds[p.Old.String()], news[p.New.String()] = true, true
	}
	if len(olds) != len(pairs) || len(news) != len(pairs) || len(pairs) != len(d.Visible) {
		return ErrInvalidValue
	}
	for _, v := range d.Visible {
		if !olds[v] {
			return ErrInvalidValue
		}
	}
	return nil
}

// State implements op.Driver.
func (d *Driver) State(pid int) (cudackpt.State, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	p, ok := d.Procs[pid]
	if !ok {
		return 0, cudackpt.ErrNotCUDA
	}
	if err := p.stopped(pid); err != nil {
		return 0, err // as cudackpt.Driver.State, which does not ask the driver then
	}
	if err, ok := d.FailNext[fmt.Sprintf("state %d", pid)]; ok {
		delete(d.FailNext, fmt.Sprintf("state %d", pid))
		return 0, err
	}
	return p.State, nil
}

// Lock implements op.Driver.
func (d *Driver) Lock(pid int, _ time.Duration) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.call("lock", pid)
	if p == nil || err != nil {
		return err
	}
	if p.State != cudackpt.Running {
		return fmt.Errorf("lock in state %v", p.State)
	}
	p.State = cudackpt.Locked
	return nil
}

// Checkpoint implements op.Driver.
func (d *Driver) Checkpoint(pid int) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.call("checkpoint", pid)
	if p == nil || err != nil {
		return err
	}
	if p.State != cudackpt.Locked {
		return fmt.Errorf("checkpoint in state %v", p.State)
	}
	p.State = cudackpt.Checkpointed
	if p.UVM != "" {
		err := os.Truncate(p.UVM, 0)
		time.Sleep(uvmCallTime) // the driver's call takes a while with the mappings gone
		return err
	}
	return nil
}

// Restore implements op.Driver.
func (d *Driver) Restore(pid int, pairs []cudackpt.Pair) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	name := "restore"
	if len(pairs) > 0 {
		name = "restore-to-" + pairs[0].New.String()
	}
	p, err := d.call(name, pid)
	if p == nil || err != nil {
		return err
	}
	if p.State != cudackpt.Checkpointed {
		return fmt.Errorf("restore in state %v", p.State)
	}
	if err := d.checkPairs(pairs); err != nil {
		return err
	}
	for _, pr := range pairs {
		if pr.Old.String() == p.GPU {
			p.GPU = pr.New.String()
			break
		}
	}
	p.State = cudackpt.Locked
	if p.UVM != "" {
		time.Sleep(uvmCallTime)
		return os.Truncate(p.UVM, testproc.UVMSize)
	}
	return nil
}

// uvmCallTime is how long a checkpoint or restore of a process with UVM set keeps the mapping
// gone within the call (the driver's take hundreds of milliseconds): long enough that its reading
// thread, if it ran, would touch it.
const uvmCallTime = 20 * time.Millisecond

// RestoreThreadID implements op.Driver: the main thread of a Real process (or one with UVM set),
// else cudackpt.ErrNoRestoreThread.
func (d *Driver) RestoreThreadID(pid int) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	p, ok := d.Procs[pid]
	switch {
	case !ok:
		return 0, cudackpt.ErrNotCUDA
	case p.UVM == "" && !p.Real:
		return 0, cudackpt.ErrNoRestoreThread
	}
	return pid, nil
}

// Unlock implements op.Driver.
func (d *Driver) Unlock(pid int) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.call("unlock", pid)
	if p == nil || err != nil {
		return err
	}
	if p.State != cudackpt.Locked {
		return fmt.Errorf("unlock in state %v", p.State)
	}
	p.State = cudackpt.Running
	return nil
}
