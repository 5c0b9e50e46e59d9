package shimstep

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"time"

	"github.com/ptxmig/ptxmig/internal/devmem"
	"github.com/ptxmig/ptxmig/internal/op"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/store"
)

// Step names of the owned-memory steps (processes whose shim owns device memory only).
const (
	StepSaveMemory    = "save-device-memory"
	StepLoadMemory    = "load-device-memory"
	StepPrepareStash  = "prepare-stash"
	StepStashMemory   = "stash-device-memory"
	StepUnstashMemory = "unstash-device-memory"
)

// Ring geometry of the owned-memory transfers: 32 slots of a chunk (128 MiB of pinned memory in
// the process at 4 MiB chunks), about what the store's ingest holds in flight (its queue and its
// workers): with 16 an 8 GiB save ran at 0.7 GB/s on an H100 host, every slot waiting for a write.
const memSlots = 32

// OwnedMemory is what an operation did with the device memory a process's shim owns.
type OwnedMemory struct {
	Save *devmem.SaveReport `json:"save,omitempty"`
	Load *devmem.LoadReport `json:"load,omitempty"`
	// Released: the physical memory was released before the driver checkpoint (which then had
	// none of it to copy); Note says why the memory was left to the driver instead.
	Released bool   `json:"released"`
	Note     string `json:"note,omitempty"`
	// Stash and Unstash (migrate): the memory parked in the process's own host memory while the
	// driver moved the rest, and put back on the target.
	Prepare *shimctl.MemPrepared    `json:"prepare,omitempty"`
	Precopy []*shimctl.MemPrecopied `json:"precopy,omitempty"`
	Stash   *shimctl.MemStashed     `json:"stash,omitempty"`
	Unstash *shimctl.MemStashed     `json:"unstash,omitempty"`
	// Target (migrate): device memory ptxmig kept on the GPU the process moves to for the
	// device-to-device copy (Stash.Target, Unstash.From say how it went); TargetNote says why there
	// was none.
	Target     *KeptTarget `json:"target,omitempty"`
	TargetNote string      `json:"target_note,omitempty"`
}

// KeptTarget is the memory kept on the target GPU for a device-to-device copy.
type KeptTarget struct {
	GPU   int    `json:"gpu"` // the CUDA ordinal in ptxmig (the NVML index on most hosts)
	UUID  string `json:"uuid"`
	Bytes uint64 `json:"bytes"`
	// KeepUS: allocating it, ptxmig's driver initialization and context included (not downtime).
	KeepUS int64 `json:"keep_us"`
}

// MemorySink gives the save step the checkpoint's store ingest (nil with a reason: the memory
// is left to the driver, as any device memory).
type MemorySink func(ctx context.Context) (devmem.Sink, devmem.Source, error)

// rescuer is a memory sink that leaves a rescue record (store.Ingest.WriteRescue): written
// before the release, it is how a recovery finds the memory's only copy, the sink's staged
// chunks, when ptxmig died before the image committed.
type rescuer interface {
	WriteRescue(key string, meta []byte, paths []string) error
}

// KindSaveMemory is the save step's kind (see op.Kind): its journal data is the pids. After a
// crash its undo loads back the memory of every recorded process whose shim holds it released,
// from the rescue record the step left in the store, so that the quiesce's undo can resume it.
const KindSaveMemory = "shim.save-memory"

func init() {
	op.RegisterKind(op.Kind{ID: KindSaveMemory, Rebuild: func(r *op.Rec, data json.RawMessage) (op.Recovery, error) {
		var x pidsData
		if err := json.Unmarshal(data, &x); err != nil {
			return op.Recovery{}, err
		}
		return op.Recovery{Undo: func(ctx context.Context) error {
			return loadRescued(ctx, r.Header.Store, r.Header.Image, x.PIDs, r.Alive(x.PIDs), r.Note)
		}}, nil
	}})
}

// loadRescued loads the owned memory of each of alive (those of all still running as
// themselves) whose shim reports it released back from the rescue records of image in the store
// at dir (a recovery, after ptxmig died), and removes the records no process needs any more: the
// ones used, and those of processes gone or not released. A record whose load failed stays.
func loadRescued(ctx context.Context, dir, image string, all, alive []int, note func(string, ...any)) error {
	if dir == "" || image == "" {
		return nil
	}
	if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() {
		return nil // no store (any more): nothing was rescued there
	}
	st, err := store.Open(dir)
	if err != nil {
		return fmt.Errorf("owned memory: open store %s for its rescue records: %w", dir, err)
	}
	var errs []error
	for _, pid := range all {
		keep, err := loadRescuedOne(ctx, st, image, pid, slices.Contains(alive, pid), note)
		if err != nil {
			errs = append(errs, fmt.Errorf("%w; the process stays held", err))
		}
		if !keep {
			if err := st.RemoveRescue(image, store.RescueKey(pid)); err != nil {
				errs = append(errs, fmt.Errorf("owned memory of pid %d: remove its rescue record: %w", pid, err))
			}
		}
	}
	return errors.Join(errs...)
}

// loadRescuedOne is loadRescued for one pid; keep reports whether its record is still needed.
func loadRescuedOne(ctx context.Context, st *store.Store, image string, pid int, alive bool, note func(string, ...any)) (keep bool, err error) {
	if !alive {
		return false, nil
	}
	c, err := dial(ctx, pid)
	if err != nil {
		if errors.Is(err, shimctl.ErrNoShim) {
			return false, nil
		}
		return true, fmt.Errorf("owned memory of pid %d: %w", pid, err)
	}
	defer c.Close()
	ms, err := memStatus(ctx, c)
	if err != nil {
		return true, fmt.Errorf("owned memory of pid %d: %w", pid, err)
	}
	if !ms.Released {
		return false, nil // its memory is in place: nothing to load
	}
	src, err := st.ReadRescue(ctx, image, store.RescueKey(pid))
	if err != nil {
		return true, fmt.Errorf("owned memory of pid %d is released; its rescue record: %w", pid, err)
	}
	defer src.Close()
	x, err := devmem.ReadIndex(ctx, src, func(string) bool { return true }, pid)
	if err == nil {
		_, err = loadInto(ctx, c, x, src)
	}
	if err != nil {
		return true, fmt.Errorf("owned memory of pid %d: load it back from the rescue record: %w", pid, err)
	}
	note("pid %d: loaded its owned device memory back (%d bytes) from the uncommitted image's rescue record", pid, x.Bytes())
	return false, nil
}

// SaveMemoryStep, after the quiesce of pids: for every quiesced process whose shim owns device
// memory, copy it into the image (chunks unchanged since prev's image by reference), leave a
// rescue record of that copy in the store (the step fails if the sink has one and cannot write
// it), and release its physical memory. Its undo loads the memory back from what was stored
// and ends the session, so that the quiesce's undo can resume the process; after a crash, the
// rebuilt undo loads it from the rescue record (KindSaveMemory).
func (p *Preemption) SaveMemoryStep(pids []int, sink MemorySink, prev func(pid int, instance string) *devmem.Prev) op.Step {
	var src devmem.Source
	saved := map[int]*devmem.Index{}
	var undo func(ctx context.Context) error
	do := func(ctx context.Context) error {
		for pid, c := range p.leases {
			if !ownsMemory(ctx, c) {
				continue // an older shim, or no owned memory: the driver moves it all
			}
			r := p.report(pid)
			s, s2, err := sink(ctx)
			if s == nil {
				r.Owned = &OwnedMemory{Note: fmt.Sprintf("left to the driver: %v", err)}
				continue
			}
			src = s2
			sess, err := c.MemBegin(ctx, "save", int64(s.ChunkSize()), memSlots, true)
			if err != nil {
				return fmt.Errorf("owned memory of pid %d: %w", pid, err)
			}
			var pv *devmem.Prev
			if prev != nil {
				pv = prev(pid, sess.Begin.Instance)
			}
			x, rep, err := devmem.Save(ctx, sess, pid, s, pv)
			cerr := sess.Close(ctx)
			if err == nil && cerr != nil {
				err = fmt.Errorf("owned memory of pid %d: end the copy: %w", pid, cerr)
			}
			if err != nil {
				return err
			}
			saved[pid] = x // from here on a rollback loads it back (if the release happened)
			if rs, ok := s.(rescuer); ok {
				paths := []string{devmem.IndexName(pid)}
				for _, rg := range x.Regions {
					paths = append(paths, rg.File)
				}
				if err := rs.WriteRescue(store.RescueKey(pid), nil, paths); err != nil {
					// Without it a ptxmig killed before the commit could not give the memory back:
					// not released, and the checkpoint fails (its memory was not touched).
					return fmt.Errorf("owned memory of pid %d: %w", pid, err)
				}
			}
			t0 := time.Now()
			rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			_, err = c.MemRelease(rctx)
			cancel()
			if err != nil {
				return fmt.Errorf("owned memory of pid %d: release: %w", pid, err)
			}
			rep.Release = time.Since(t0)
			r.Owned = &OwnedMemory{Save: rep, Released: true}
		}
		return nil
	}
	undo = func(ctx context.Context) error {
		var errs []error
		for pid, x := range saved {
			c, done, err := p.client(ctx, pid)
			if err != nil {
				errs = append(errs, fmt.Errorf("owned memory of pid %d: %w; the process stays held with its memory released", pid, err))
				continue
			}
			st, err := memStatus(ctx, c)
			if err == nil && st.Released {
				_, err = loadInto(ctx, c, x, src)
			}
			done()
			if err != nil {
				errs = append(errs, err)
				continue
			}
			if o := p.report(pid).Owned; o != nil {
				o.Released = false
			}
			delete(saved, pid)
		}
		return errors.Join(errs...)
	}
	return op.Step{Name: StepSaveMemory, Kind: KindSaveMemory, Data: pidsData{PIDs: pids}, Undo: undo,
		// A failure after some processes' memory was released loads theirs back here: the
		// transaction does not undo the step that failed.
		Do: func(ctx context.Context) error {
			err := do(ctx)
			return undoPartial(ctx, err, len(saved) > 0, undo, "load the owned memory back")
		}}
}

// Saved returns the instances of the processes whose owned memory the save step stored.
func (p *Preemption) Saved() map[int]string {
	m := map[int]string{}
	for _, r := range p.Reports {
		if r.Owned != nil && r.Owned.Save != nil {
			m[r.PID] = r.Owned.Save.Instance
		}
	}
	return m
}

// LoadMemoryStep, after the driver restore and unlock and before the resume: for every process
// whose shim has its owned memory released, re-create it and load it from src (the image), the
// index read through has/src. No undo: a failure rolls back the whole restore (the process goes).
func (p *Preemption) LoadMemoryStep(pids func() []int, src devmem.Source, has func(string) bool) op.Step {
	return op.Step{Name: StepLoadMemory, Do: func(ctx context.Context) error {
		for _, pid := range pids() {
			c, done, err := p.client(ctx, pid)
			if errors.Is(err, shimctl.ErrNoShim) {
				continue
			}
			if err != nil {
				return fmt.Errorf("owned memory of pid %d: %w", pid, err)
			}
			defer done()
			st, err := memStatus(ctx, c)
			if err != nil || !st.Released {
				continue
			}
			x, err := devmem.ReadIndex(ctx, src, has, pid)
			if err == nil && x == nil {
				err = errors.New("its memory is released but the image has no owned-memory index")
			}
			if err != nil {
				return fmt.Errorf("owned memory of pid %d: %w", pid, err)
			}
			rep, err := loadInto(ctx, c, x, src)
			if err != nil {
				return err
			}
			r := p.report(pid)
			if r.Owned == nil {
				r.Owned = &OwnedMemory{}
			}
			r.Owned.Load, r.Owned.Released = rep, false
		}
		return nil
	}}
}

// client returns the open lease of pid, or a new connection (after a detach, in a restored
// process) and what to call when done with it.
func (p *Preemption) client(ctx context.Context, pid int) (*shimctl.Client, func(), error) {
	if c, ok := p.leases[pid]; ok {
		return c, func() {}, nil
	}
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	c, err := dial(dctx, pid)
	if err != nil {
		return nil, nil, err
	}
	return c, func() { c.Close() }, nil
}

func loadInto(ctx context.Context, c *shimctl.Client, x *devmem.Index, src devmem.Source) (*devmem.LoadReport, error) {
	if src == nil {
		return nil, fmt.Errorf("owned memory of pid %d: nothing to load it from", x.PID)
	}
	sess, err := c.MemBegin(ctx, "load", x.ChunkBytes, memSlots, false)
	if err != nil {
		return nil, fmt.Errorf("owned memory of pid %d: %w", x.PID, err)
	}
	rep, err := devmem.Load(ctx, sess, x, src)
	cerr := sess.Close(ctx)
	if err == nil && cerr != nil {
		err = fmt.Errorf("owned memory of pid %d: end the load: %w", x.PID, cerr)
	}
	return rep, err
}

// stashTimeout bounds one process's stash or unstash: copies at 1 GB/s or more of up to the
// host's largest GPU memory.
const stashTimeout = 10 * time.Minute

// Pre-copy rounds (PrepareStashStep): at most maxRounds; a round after which less than
// 1/unpinShare of the memory changed is followed by a last one that unpins the stash; rounds
// stop when the changed set no longer shrinks to below shrinkRatio of the round before.
const (
	maxRounds   = 4
	unpinShare  = 8
	shrinkRatio = 0.7
)

// PrepareStashStep, before the quiesce (migrate): every process of pids whose shim owns device
// memory readies the host memory its stash will take, while it still runs, and with precopy
// copies its memory there in rounds, each copying the chunks changed since the round before,
// while the changed set shrinks (as live VM migration does): the stop then copies only what
// changed since the last round. Best effort: a process that cannot prepare (an older shim, no
// host memory) stashes into memory it maps in the stop, or fails there; a failed round leaves
// the stop to copy everything. Nothing to undo: the shim frees an unused stash by itself.
func (p *Preemption) PrepareStashStep(pids []int, precopy bool) op.Step {
	return op.Step{Name: StepPrepareStash, Do: func(ctx context.Context) error {
		for _, pid := range pids {
			dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			c, err := dial(dctx, pid)
			cancel()
			if err != nil {
				continue // no shim: nothing owned; unreachable: the quiesce says so
			}
			if ownsMemory(ctx, c) {
				sctx, cancel := context.WithTimeout(ctx, stashTimeout)
				x, perr := c.MemPrepare(sctx)
				cancel()
				if perr != nil {
					p.log("owned memory: preparing the stash failed; it is made in the stop", "pid", pid, "err", perr)
				} else {
					o := &OwnedMemory{Prepare: x}
					p.report(pid).Owned = o
					if x.Bytes > 0 { // before the rounds: the allocation (ptxmig's cuInit too) takes a while
						p.keepTarget(pid, x.Bytes, o)
					}
					if precopy && x.Bytes > 0 {
						o.Precopy = p.precopy(ctx, c, pid, x.Bytes)
					}
				}
			}
			c.Close()
		}
		return nil
	}}
}

// keepTarget allocates, while the process runs, the memory on its target GPU that the stash step
// copies its owned memory into device to device (KeepTarget). Best effort: without it the memory
// goes through the stash alone, and the report says why.
func (p *Preemption) keepTarget(pid int, bytes uint64, o *OwnedMemory) {
	if p.KeepTarget == nil {
		return
	}
	t0 := time.Now()
	k, err := p.KeepTarget(pid, bytes)
	var kt *keptTarget
	if err == nil {
		// Both descriptors now: exporting and freeing are ptxmig's driver calls, kept out of the
		// stop (the memory is freed by Close, after the resume).
		kt = &keptTarget{k: k}
		if kt.stash, err = k.Export(); err == nil {
			kt.unstash, err = k.Export()
		}
		if err != nil {
			kt.free()
		}
	}
	if err != nil {
		o.TargetNote = fmt.Sprintf("no device-to-device copy (%v): the memory goes through host memory", err)
		p.log("owned memory: no device-to-device copy", "pid", pid, "err", err)
		return
	}
	if p.kept == nil {
		p.kept = map[int]*keptTarget{}
	}
	p.kept[pid] = kt
	o.Target = &KeptTarget{GPU: k.Device.Ordinal, UUID: k.Device.UUID.String(), Bytes: k.Size, KeepUS: time.Since(t0).Microseconds()}
}

// free closes the descriptors and frees the memory.
func (kt *keptTarget) free() error {
	for _, f := range []*os.File{kt.stash, kt.unstash} {
		if f != nil {
			f.Close()
		}
	}
	return kt.k.Free()
}

// dropTarget frees the memory kept for pid's device-to-device copy, if any.
func (p *Preemption) dropTarget(pid int) {
	if kt, ok := p.kept[pid]; ok {
		delete(p.kept, pid)
		if err := kt.free(); err != nil {
			p.log("owned memory: freeing the device-to-device copy's memory failed", "pid", pid, "err", err)
		}
	}
}

// precopy runs the pre-copy rounds of one process (see PrepareStashStep).
func (p *Preemption) precopy(ctx context.Context, c *shimctl.Client, pid int, total uint64) []*shimctl.MemPrecopied {
	var out []*shimctl.MemPrecopied
	unpin := false
	for len(out) < maxRounds {
		sctx, cancel := context.WithTimeout(ctx, stashTimeout)
		x, err := c.MemPrecopy(sctx, unpin)
		cancel()
		if err != nil {
			p.log("owned memory: a pre-copy round failed; the stop copies everything", "pid", pid, "err", err)
			break
		}
		out = append(out, x)
		if unpin {
			break
		}
		switch {
		case x.Bytes*unpinShare < total:
			unpin = true // little changed: one more round, then the stop copies from pageable memory
		case len(out) > 1 && float64(x.Bytes) > shrinkRatio*float64(out[len(out)-2].Bytes):
			return out // not converging: stop here, the stash stays pinned for a full copy
		}
	}
	return out
}

// StashMemoryStep, after the quiesce (migrate): every quiesced process whose shim owns device
// memory copies it into its own host memory and releases it, so the driver's checkpoint and
// restore move only the rest of its GPU state. The bytes stay in the process: if ptxmig dies,
// the shim puts them back when the lease ends (or at the recovery's resume). A failure for one
// process unstashes those done before it; the undo unstashes every process (on the GPUs it is on
// by then: the driver steps' undos have moved it back).
func (p *Preemption) StashMemoryStep() op.Step {
	var stashed []int
	undo := func(ctx context.Context) error {
		var errs []error
		for i := len(stashed) - 1; i >= 0; i-- {
			pid := stashed[i]
			if err := p.unstash(ctx, pid); err != nil {
				errs = append(errs, err)
				continue
			}
			stashed = slices.Delete(stashed, i, i+1)
		}
		return errors.Join(errs...)
	}
	do := func(ctx context.Context) error {
		for _, pid := range slices.Sorted(maps.Keys(p.leases)) {
			c := p.leases[pid]
			if !ownsMemory(ctx, c) {
				continue // an older shim, or no owned memory: the driver moves it all
			}
			x, err := p.stash(ctx, c, pid)
			if err != nil {
				return fmt.Errorf("owned memory of pid %d: stash: %w", pid, err)
			}
			stashed = append(stashed, pid)
			r := p.report(pid)
			if r.Owned == nil {
				r.Owned = &OwnedMemory{}
			}
			r.Owned.Stash, r.Owned.Released = x, x.Regions > 0
		}
		return nil
	}
	return op.Step{Name: StepStashMemory, Undo: undo, Do: func(ctx context.Context) error {
		err := do(ctx)
		return undoPartial(ctx, err, len(stashed) > 0, undo, "put the stashed memory back")
	}}
}

// stash runs pid's mem-stash, copying into the memory kept on its target GPU too when there is
// some (a copy that did not fill it frees it: the unstash then copies from the stash).
func (p *Preemption) stash(ctx context.Context, c *shimctl.Client, pid int) (*shimctl.MemStashed, error) {
	sctx, cancel := context.WithTimeout(ctx, stashTimeout)
	defer cancel()
	kt, ok := p.kept[pid]
	if !ok {
		return c.MemStash(sctx)
	}
	x, err := c.MemStashTo(sctx, kt.stash, kt.k.Size)
	if err != nil || x.Target == nil || !x.Target.Filled {
		p.dropTarget(pid)
	}
	return x, err
}

// UnstashMemoryStep, after the driver restore and unlock (migrate): every process whose memory
// is stashed re-creates it on the GPU it now runs on and copies it back. No undo of its own: if
// it fails, the driver steps' undos move the processes back and the stash step's undo puts the
// memory back there (a process already unstashed has nothing stashed left).
func (p *Preemption) UnstashMemoryStep() op.Step {
	return op.Step{Name: StepUnstashMemory, Do: func(ctx context.Context) error {
		for _, r := range p.Reports {
			if r.Owned == nil || r.Owned.Stash == nil || !r.Owned.Released {
				continue
			}
			if err := p.unstashFrom(ctx, r.PID, true); err != nil {
				return err
			}
		}
		return nil
	}}
}

// unstash puts pid's stashed memory back from the stash (a rollback: the process is back on its
// source GPU).
func (p *Preemption) unstash(ctx context.Context, pid int) error {
	return p.unstashFrom(ctx, pid, false)
}

// unstashFrom puts pid's stashed memory back; with target, from the memory kept on the GPU it
// moved to where the stash step filled it (device to device, no pinning), else from the stash.
// The kept memory is freed by Close, after the resume.
func (p *Preemption) unstashFrom(ctx context.Context, pid int, target bool) error {
	c, done, err := p.client(ctx, pid)
	if err != nil {
		return fmt.Errorf("owned memory of pid %d: %w; its shim puts the memory back when it is resumed", pid, err)
	}
	defer done()
	sctx, cancel := context.WithTimeout(ctx, stashTimeout)
	var x *shimctl.MemStashed
	if kt, ok := p.kept[pid]; ok && target {
		x, err = c.MemUnstashFrom(sctx, kt.unstash)
	} else {
		x, err = c.MemUnstash(sctx)
	}
	cancel()
	if err != nil {
		return fmt.Errorf("owned memory of pid %d: unstash: %w", pid, err)
	}
	if o := p.report(pid).Owned; o != nil {
		if x.Regions > 0 {
			o.Unstash = x
		}
		o.Released = false
	}
	return nil
}

// memStatus asks a shim for its owned-memory overview (bounded).
func memStatus(ctx context.Context, c *shimctl.Client) (*shimctl.MemStatus, error) {
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return c.MemStatus(sctx)
}

// ownsMemory reports whether a shim owns device memory (false for an older shim).
func ownsMemory(ctx context.Context, c *shimctl.Client) bool {
	st, err := memStatus(ctx, c)
	return err == nil && st.Enabled && st.Regions > 0
}

// undoPartial is a step's own rollback when its Do failed after touching some processes
// (touched): the transaction does not undo the step that failed, so undo runs here (what says
// what it does) and the error says whether it did.
func undoPartial(ctx context.Context, err error, touched bool, undo func(context.Context) error, what string) error {
	if err == nil || !touched {
		return err
	}
	if uerr := undo(context.WithoutCancel(ctx)); uerr != nil {
		return op.StepUndid(err, fmt.Errorf("%s: %w", what, uerr))
	}
	return op.StepUndid(err, nil)
}
