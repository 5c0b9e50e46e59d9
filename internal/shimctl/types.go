package shimctl

// Status is the result of the "status" request.
type Status struct {
	PID             int     `json:"pid"`
	Shim            string  `json:"shim"`
	Proto           int     `json:"proto"`
	Exe             string  `json:"exe"`
	UptimeS         float64 `json:"uptime_s"`
	CUDAInitialized bool    `json:"cuda_initialized"`
	DriverCUDA      int     `json:"driver_cuda_version,omitempty"`
	PeerAccess      int     `json:"peer_access"` // peer links enabled between the process's contexts
	// PeerAccessOff: started with PTXMIG_PEER_ACCESS=0 (`ptxmig run --no-peer-access`), the GPUs
	// answer as without a peer path; PeerAccessRefused counts the enables refused so.
	PeerAccessOff     bool `json:"peer_access_off,omitempty"`
	PeerAccessRefused int  `json:"peer_access_refused,omitempty"`
	// PeerToggle: the shim turns the process's peer access off for a checkpoint and on again after
	// (peer-off, peer-on; false from older shims); PeerSuspended: it is off now.
	PeerToggle    bool `json:"peer_toggle,omitempty"`
	PeerSuspended bool `json:"peer_access_suspended,omitempty"`
	// LargestDeviceAlloc: bytes of the largest live cuMemAlloc (or pitched) allocation (0 from
	// older shims): driver 580 cannot turn peer access to a context holding one over 256 MiB back
	// on after a restore.
	LargestDeviceAlloc uint64            `json:"largest_device_alloc,omitempty"`
	IPC                *IPC              `json:"ipc,omitempty"`         // nil from a shim that predates it
	Collectives        *Collectives      `json:"collectives,omitempty"` // NCCL launches and the alignment hold (older shims: nil)
	Devices            []Device          `json:"devices"`
	Contexts           []Context         `json:"contexts"`
	Allocations        map[string]any    `json:"allocations"`
	Modules            []Module          `json:"modules"`
	Interception       map[string]uint64 `json:"interception"`
	Launches           map[string]uint64 `json:"launches"`
	Sampling           map[string]uint64 `json:"sampling"`
	Preempt            *PreemptStatus    `json:"preempt,omitempty"` // protocol 2
}

// IPC is the GPU memory a process shares with other processes, as its shim counts it (status
// "ipc"; docs/SHIM-PROTOCOL.md says exactly what is counted): live exports (memory of this
// process another process may map) and imports (memory of another process this one maps), in
// total and per mechanism.
type IPC struct {
	Exported    int        `json:"exported"`
	Imported    int        `json:"imported"`
	IPCMem      ShareCount `json:"ipc_mem"`  // CUDA IPC: cuIpcGetMemHandle, cuIpcOpenMemHandle
	VMM         ShareCount `json:"vmm"`      // cuMemExportToShareableHandle, cuMemImportFromShareableHandle
	Pool        ShareCount `json:"pool"`     // cuMemPoolExportToShareableHandle, cuMemPoolImportFromShareableHandle
	PoolPointer ShareCount `json:"pool_ptr"` // cuMemPoolExportPointer, cuMemPoolImportPointer
	ExportCalls uint64     `json:"export_calls"`
	ImportCalls uint64     `json:"import_calls"`
	Untracked   ShareCount `json:"untracked"` // records the shim could not keep: counted in the totals for good
}

// ShareCount is one mechanism's live exports and imports.
type ShareCount struct {
	Exported int `json:"exported"`
	Imported int `json:"imported"`
}

// PreemptStatus is the shim's preemption state (protocol 2).
type PreemptStatus struct {
	Mode                string             `json:"mode"`
	State               string             `json:"state"`
	TwinsInFlight       int                `json:"twins_in_flight"`
	Stopping            int                `json:"stopping"` // twins raised after a quiesce that have not ended yet
	InstrumentedModules int                `json:"instrumented_modules"`
	Cache               map[string]float64 `json:"cache,omitempty"`
}

// Device is one CUDA device as the driver reports it inside the process.
type Device struct {
	Ordinal           int    `json:"ordinal"`
	Name              string `json:"name"`
	UUID              string `json:"uuid,omitempty"`
	TotalBytes        uint64 `json:"total_bytes"`
	ComputeCapability string `json:"compute_capability"`
}

// Context is a CUDA context the process created or retained.
type Context struct {
	Handle  string `json:"handle"`
	Device  int    `json:"device"`
	Primary bool   `json:"primary"`
}

// AllocTotal is one allocation kind's live count and bytes.
type AllocTotal struct {
	Count     uint64 `json:"count"`
	Bytes     uint64 `json:"bytes"`
	PeakBytes uint64 `json:"peak_bytes"`
}

// Module is one captured module or library image.
type Module struct {
	ID          int    `json:"id"`
	Source      string `json:"source"`
	Handle      string `json:"handle"`
	Loaded      bool   `json:"loaded"`
	Format      string `json:"format"`
	Bytes       uint64 `json:"bytes"`
	SHA256      string `json:"sha256,omitempty"`
	PTX         int    `json:"ptx"`
	ELF         int    `json:"elf"`
	Archs       string `json:"archs,omitempty"`
	Path        string `json:"path,omitempty"`
	ParseError  string `json:"parse_error,omitempty"`
	NotCaptured string `json:"not_captured,omitempty"`
}

// Kernels is the result of the "kernels" request.
type Kernels struct {
	Kernels       []Kernel       `json:"kernels"`
	Graphs        []Graph        `json:"graphs"`
	TotalLaunches uint64         `json:"total_launches"`
	Sampling      map[string]int `json:"sampling"`
	SelfTime      *SelfTime      `json:"self_time,omitempty"`
}

// SelfTime is the shim's own time on the launch path (PTXMIG_SELF_TIME=1 in the app's environment).
type SelfTime struct {
	Enabled  bool   `json:"enabled"`
	Launches uint64 `json:"launches"`
	Ns       uint64 `json:"ns"`
	ClockNs  uint64 `json:"clock_ns"` // one clock read; each launch's Ns includes about two
}

// Kernel is the launch accounting of one function or kernel handle.
type Kernel struct {
	Name        *string `json:"name"`
	Handle      string  `json:"handle"`
	Module      int     `json:"module"`
	Launches    uint64  `json:"launches"`
	Failed      uint64  `json:"failed"`
	Cooperative uint64  `json:"cooperative"`
	Shapes      []Shape `json:"shapes"`
	OtherShapes uint64  `json:"other_shapes"`
	Timed       uint64  `json:"timed"`
	Time        *Timing `json:"time_us,omitempty"`
	// Protocol 2: whether the kernel's module carries a preemptible twin, why not, and how many
	// launches ran as the twin.
	Twin         bool   `json:"twin"`
	TwinReason   string `json:"twin_reason,omitempty"`
	TwinLaunches uint64 `json:"twin_launches"`
	// OriginalReason: for a kernel with a twin, why its last launch that ran as the original did
	// (the auto policy: short kernel, one-wave grid, lower occupancy; or a stream capture...).
	OriginalReason string `json:"original_reason,omitempty"`
	// MidBlock: the twin also stops inside a block (its module carries the record layout, read
	// at its first twin launch); nil otherwise.
	MidBlock *MidBlockKernel `json:"mid_block,omitempty"`
	// MidTwin: the module also carries a second, mid-block twin, launched where the block twin
	// could not stop in time: grids that fit in one wave, blocks expected to run long
	// (PTXMIG_MID_BLOCK=auto, `ptxmig run`'s default).
	MidTwin bool `json:"mid_twin,omitempty"`
}

// MidBlockKernel is a mid-block twin's record layout and how often it ran and stopped inside a block.
type MidBlockKernel struct {
	Sites             uint32 `json:"sites"`
	RegisterSlots     uint32 `json:"register_slots"`
	StaticSharedBytes uint32 `json:"static_shared_bytes"`
	LocalBytes        uint32 `json:"local_bytes"`
	Launches          uint64 `json:"launches"` // twin launches with save areas
	Stops             uint64 `json:"stops"`    // quiesces that stopped it inside a block
}

// Shape is a grid/block configuration and how often it was launched.
type Shape struct {
	Grid     [3]uint32 `json:"grid"`
	Block    [3]uint32 `json:"block"`
	Launches uint64    `json:"launches"`
}

// Timing summarises sampled GPU times in microseconds.
type Timing struct {
	P50  float64 `json:"p50"`
	P99  float64 `json:"p99"`
	Mean float64 `json:"mean"`
	Max  float64 `json:"max"`
}

// Graph is the launch count of one graph exec.
type Graph struct {
	Exec     string `json:"exec"`
	Launches uint64 `json:"launches"`
	Failed   uint64 `json:"failed"`
}

// Dump is the result of "dump-modules".
type Dump struct {
	Dir          string `json:"dir"`
	Modules      int    `json:"modules"`
	PTX          int    `json:"ptx"`
	Cubin        int    `json:"cubin"`
	FilesWritten int    `json:"files_written"`
	Errors       int    `json:"errors"`
	Index        string `json:"index"`
}
