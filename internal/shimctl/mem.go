package shimctl

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Owned device memory (docs/SHIM-PROTOCOL.md, "Owned device memory"): under `ptxmig run
// --owned-memory` the shim serves cuMemAlloc from VMM mappings, and moves them itself through a
// ring of slots in a memfd it passes over the socket.

// MemStatus is the shim's owned-memory overview (also status.owned_memory).
type MemStatus struct {
	Enabled   bool   `json:"enabled"`
	MinBytes  uint64 `json:"min_bytes"`
	Regions   int    `json:"regions"`
	Bytes     uint64 `json:"bytes"`
	PeakBytes uint64 `json:"peak_bytes"`
	Released  bool   `json:"released"`
	Stashed   bool   `json:"stashed"` // released into the process's own host memory (mem-stash)
	// StashBytes: host memory the stash holds (prepared, stashed, or put back and not freed yet).
	StashBytes  uint64 `json:"stash_bytes"`
	Allocations uint64 `json:"allocations"`
	Fallbacks   uint64 `json:"fallbacks"`
	Frees       uint64 `json:"frees"`
	IPCRefused  uint64 `json:"ipc_refused"`
}

// MemRegion is one owned allocation: its mapping [VA, VA+Size), of which the first Bytes (Asked
// rounded up to 256) are moved, in chunks of the session's chunk size.
type MemRegion struct {
	VA     uint64 `json:"va"`
	Size   uint64 `json:"size"`
	Asked  uint64 `json:"asked"`
	Bytes  uint64 `json:"bytes"`
	Device int    `json:"device"`
	Hashes string `json:"hashes,omitempty"` // 32 hex digits per chunk (GPU hash), save with hash only
}

// Chunks is the number of chunks of r at chunk bytes each.
func (r MemRegion) Chunks(chunk int64) int64 {
	return int64((r.Bytes + uint64(chunk) - 1) / uint64(chunk))
}

// ChunkHash returns the GPU hash of r's chunk k ("" without hashes).
func (r MemRegion) ChunkHash(k int64) string {
	if r.Hashes == "" {
		return ""
	}
	return r.Hashes[32*k : 32*k+32]
}

// MemBegin is what the shim answered when a transfer began.
type MemBegin struct {
	Dir        string      `json:"dir"`
	Instance   string      `json:"instance"` // names the process's owned memory across checkpoints
	ChunkBytes int64       `json:"chunk_bytes"`
	Slots      int         `json:"slots"`
	Pinned     bool        `json:"pinned"`
	Chunks     int64       `json:"chunks"`
	Hash       string      `json:"hash"`
	SyncUS     int64       `json:"sync_us"`
	RemapUS    int64       `json:"remap_us"`
	HashUS     int64       `json:"hash_us"`
	Regions    []MemRegion `json:"regions"`
}

// MemCopied is the end of a save or a fill.
type MemCopied struct {
	Chunks    int64 `json:"chunks"`
	Copied    int64 `json:"copied"`
	Skipped   int64 `json:"skipped"`
	Bytes     int64 `json:"bytes"`
	ElapsedUS int64 `json:"elapsed_us"`
	// GPUWaitUS: the shim waited for its copies (save); PeerWaitUS: for ptxmig (a slot back, the
	// next chunk).
	GPUWaitUS  int64 `json:"gpu_wait_us"`
	PeerWaitUS int64 `json:"peer_wait_us"`
}

// MemReleased is the reply to mem-release.
type MemReleased struct {
	Bytes     uint64 `json:"released_bytes"`
	Regions   int    `json:"regions"`
	ElapsedUS int64  `json:"elapsed_us"`
}

// MemStashed is the reply to mem-stash and mem-unstash: Bytes of Regions went into (out of) the
// process's own host memory, pinned for the copy (Pinned) or pageable. The durations are
// microseconds: synchronizing the app's work (stash), re-creating the physical memory (unstash),
// pinning and unpinning the stash, the copies, releasing the physical memory (stash), and all.
// A stash made ready by MemPrepare (Prepared) is not populated or pinned in the stop.
type MemStashed struct {
	Regions int    `json:"regions"`
	Bytes   uint64 `json:"bytes"`
	// CopiedBytes: what the stash copied in the stop (less than Bytes after pre-copy rounds,
	// Precopied); HashUS: the GPU hash that found the chunks still to copy.
	CopiedBytes uint64 `json:"copied_bytes,omitempty"`
	Precopied   bool   `json:"precopied,omitempty"`
	HashUS      int64  `json:"hash_us,omitempty"`
	Prepared    bool   `json:"prepared,omitempty"`
	Pinned      bool   `json:"pinned"`
	SyncUS      int64  `json:"sync_us,omitempty"`
	RemapUS     int64  `json:"remap_us,omitempty"`
	PopulateUS  int64  `json:"populate_us,omitempty"`
	PinUS       int64  `json:"pin_us"`
	CopyUS      int64  `json:"copy_us"`
	UnpinUS     int64  `json:"unpin_us,omitempty"`
	ReleaseUS   int64  `json:"release_us,omitempty"`
	ElapsedUS   int64  `json:"elapsed_us"`
	// Target: mem-stash's copy into memory kept on the target GPU (MemStashTo); From:
	// mem-unstash's source, "target" (that copy, device to device) or "host" (the stash), and
	// why not the target copy when one was given (TargetError).
	Target      *MemTarget `json:"target,omitempty"`
	From        string     `json:"from,omitempty"`
	TargetError string     `json:"target_error,omitempty"`
}

// MemTarget is mem-stash's report of the target copy: Filled when every region went into it
// (Bytes), the time to import and map it and to copy; Error says why not (the stash alone is
// then used).
type MemTarget struct {
	Filled bool   `json:"filled"`
	Bytes  uint64 `json:"bytes"`
	MapUS  int64  `json:"map_us"`
	CopyUS int64  `json:"copy_us"`
	Error  string `json:"error,omitempty"`
}

// MemPrepared is the reply to mem-prepare: Bytes of host memory populated and pinned (0: none).
type MemPrepared struct {
	Bytes      uint64 `json:"bytes"`
	Pinned     bool   `json:"pinned"`
	PopulateUS int64  `json:"populate_us"`
	PinUS      int64  `json:"pin_us"`
}

const maxMemSlots = 64

func (b *MemBegin) validate(dir string, chunk int64, slots int) error {
	if b.Dir != dir || b.ChunkBytes != chunk || b.Slots != slots {
		return fmt.Errorf("dir %q chunk %d slots %d, asked %q %d %d", b.Dir, b.ChunkBytes, b.Slots, dir, chunk, slots)
	}
	if _, err := hex.DecodeString(b.Instance); err != nil || len(b.Instance) != 16 {
		return fmt.Errorf("instance %q is not 16 hex digits", b.Instance)
	}
	var total int64
	var end uint64
	for i, r := range b.Regions {
		switch {
		case r.VA == 0 || r.VA < end || r.Size == 0 || r.Size > 1<<46 || r.VA+r.Size < r.VA:
			return fmt.Errorf("region %d: bad range %#x+%d", i, r.VA, r.Size)
		case r.Asked == 0 || r.Asked > r.Bytes || r.Bytes > r.Size || r.Bytes%256 != 0 || r.Bytes-r.Asked >= 256:
			return fmt.Errorf("region %d: bytes %d, asked %d, size %d", i, r.Bytes, r.Asked, r.Size)
		case r.Device < 0 || r.Device > 1024:
			return fmt.Errorf("region %d: device %d", i, r.Device)
		}
		n := r.Chunks(chunk)
		if r.Hashes != "" || b.Hash != "" {
			if b.Hash != "ptxmig-gpuhash-1" || int64(len(r.Hashes)) != 32*n {
				return fmt.Errorf("region %d: %d hash digits for %d chunks (hash %q)", i, len(r.Hashes), n, b.Hash)
			}
			if _, err := hex.DecodeString(r.Hashes); err != nil {
				return fmt.Errorf("region %d: hashes: %v", i, err)
			}
		}
		total += n
		end = r.VA + r.Size
	}
	if total != b.Chunks {
		return fmt.Errorf("%d chunks, the regions have %d", b.Chunks, total)
	}
	return nil
}

// MemStatus asks for the owned-memory overview.
func (c *Client) MemStatus(ctx context.Context) (*MemStatus, error) {
	return call[MemStatus](ctx, c, "mem-status", nil)
}

// MemRelease unmaps and releases the physical memory of every owned region (the addresses stay
// reserved): the driver checkpoint then has none of it to copy. The connection must hold the
// quiesce lease.
func (c *Client) MemRelease(ctx context.Context) (*MemReleased, error) {
	return call[MemReleased](ctx, c, "mem-release", nil)
}

// MemPrepare, while the process runs (any connection), readies the host memory a MemStash will
// copy into, so that populating and pinning it does not count in the stop. The shim frees it
// if no stash follows within a minute.
func (c *Client) MemPrepare(ctx context.Context) (*MemPrepared, error) {
	return call[MemPrepared](ctx, c, "mem-prepare", nil)
}

// MemPrecopied is the reply to a mem-precopy round: Copied of Chunks (4 MiB each) differed from
// what the stash held and were copied (Bytes); the GPU hashes of the memory and then of what the
// stash received took HashUS and StashHashUS. Pinned: the stash stays pinned after the round.
type MemPrecopied struct {
	Round       int    `json:"round"`
	Chunks      int64  `json:"chunks"`
	Copied      int64  `json:"copied_chunks"`
	Bytes       uint64 `json:"bytes"`
	HashUS      int64  `json:"hash_us"`
	CopyUS      int64  `json:"copy_us"`
	StashHashUS int64  `json:"stash_hash_us"`
	Pinned      bool   `json:"pinned"`
	ElapsedUS   int64  `json:"elapsed_us"`
}

// MemPrecopy runs one pre-copy round into the prepared stash while the process runs (any
// connection); unpin unpins the stash after it (for a last round after which little is left to
// copy: the stop then skips the unpin).
func (c *Client) MemPrecopy(ctx context.Context, unpin bool) (*MemPrecopied, error) {
	var args map[string]any
	if unpin {
		args = map[string]any{"unpin": 1}
	}
	return call[MemPrecopied](ctx, c, "mem-precopy", args)
}

// MemStash copies every owned region into the process's own host memory and releases its
// physical memory (the addresses stay reserved), with the process quiesced through this
// connection. Until MemUnstash, a resume of the process, or the lease's end, which all put the
// memory back first, the bytes live only in the process: nothing is lost if ptxmig dies.
func (c *Client) MemStash(ctx context.Context) (*MemStashed, error) {
	return call[MemStashed](ctx, c, "mem-stash", nil)
}

// MemStashTo is MemStash that also copies the regions into target, device memory of size bytes
// that ptxmig keeps on the GPU the process moves to (an exported POSIX fd), before releasing
// them; the shim drops its mapping of target before it replies. A target it cannot use is
// reported in the reply's Target, not as an error: the stash holds everything.
func (c *Client) MemStashTo(ctx context.Context, target *os.File, size uint64) (*MemStashed, error) {
	return callWith[MemStashed](ctx, c, "mem-stash", map[string]any{"target_bytes": size}, target)
}

// MemUnstashFrom is MemUnstash copying from target (the memory MemStashTo filled, exported
// again) where it can, else from the stash; the reply's From says which.
func (c *Client) MemUnstashFrom(ctx context.Context, target *os.File) (*MemStashed, error) {
	return callWith[MemStashed](ctx, c, "mem-unstash", nil, target)
}

// MemUnstash re-creates the stashed regions at their addresses, on their device ordinals, and
// copies them back; nothing to do when nothing is stashed.
func (c *Client) MemUnstash(ctx context.Context) (*MemStashed, error) {
	return call[MemStashed](ctx, c, "mem-unstash", nil)
}

// call sends cmd with args (may be nil) and decodes its result into a T.
func call[T any](ctx context.Context, c *Client, cmd string, args map[string]any) (*T, error) {
	return callWith[T](ctx, c, cmd, args, nil)
}

// callWith is call with f's descriptor attached to the request (nil: none).
func callWith[T any](ctx context.Context, c *Client, cmd string, args map[string]any, f *os.File) (*T, error) {
	raw, err := c.rawWith(ctx, cmd, args, f)
	if err != nil {
		return nil, err
	}
	var v T
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, fmt.Errorf("%s: %w: %v", cmd, ErrProtocol, err)
	}
	return &v, nil
}

// MemSession is an open transfer: the shim's ring mapped here.
type MemSession struct {
	c     *Client
	Begin *MemBegin
	ring  []byte
	wmu   sync.Mutex // writes to the connection (slots are freed from the store's workers)
}

// MemBegin opens a transfer: dir "save" (the process quiesced, its memory live; hash asks for
// the chunks' GPU hashes) or "load" (its memory released: the shim re-creates it first). The
// reply carries the ring's memfd, mapped here.
func (c *Client) MemBegin(ctx context.Context, dir string, chunk int64, slots int, hash bool) (*MemSession, error) {
	if slots < 1 || slots > maxMemSlots {
		return nil, fmt.Errorf("mem-begin: slots %d out of 1..%d", slots, maxMemSlots)
	}
	h := 0
	if hash {
		h = 1
	}
	line, _ := json.Marshal(map[string]any{"cmd": "mem-begin", "dir": dir, "chunk_bytes": chunk, "slots": slots, "hash": h})
	if c.r.Buffered() > 0 {
		return nil, fmt.Errorf("mem-begin: %w: unread bytes before the request", ErrProtocol)
	}
	stop, err := c.deadline(ctx, 5*time.Minute)
	if err != nil {
		return nil, err
	}
	defer stop()
	if _, err := c.conn.Write(append(line, '\n')); err != nil {
		return nil, fmt.Errorf("mem-begin: send to %s: %w", c.path, err)
	}
	reply, fd, err := c.readWithFD(16 << 20)
	if err != nil {
		return nil, fmt.Errorf("mem-begin: %w", err)
	}
	res, proto, err := parseReply("mem-begin", reply)
	if proto > 0 {
		c.proto = proto
	}
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return nil, err
	}
	if fd < 0 {
		return nil, fmt.Errorf("mem-begin: %w: no ring descriptor with the reply", ErrProtocol)
	}
	f := os.NewFile(uintptr(fd), "ptxmig-devmem-ring")
	defer f.Close() // the mapping stays
	var b MemBegin
	if err := json.Unmarshal(res, &b); err != nil {
		return nil, fmt.Errorf("mem-begin: %w: %v", ErrProtocol, err)
	}
	if err := b.validate(dir, chunk, slots); err != nil {
		return nil, fmt.Errorf("mem-begin: %w: %v", ErrProtocol, err)
	}
	size := chunk * int64(slots)
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() || fi.Size() < size {
		return nil, fmt.Errorf("mem-begin: %w: the ring is not a file of %d bytes", ErrProtocol, size)
	}
	ring, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mem-begin: map the ring: %w", err)
	}
	return &MemSession{c: c, Begin: &b, ring: ring}, nil
}

// deadline applies ctx (or max from now) to the connection until stop is called.
func (c *Client) deadline(ctx context.Context, max time.Duration) (func(), error) {
	d := time.Now().Add(max)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		d = cd
	}
	if err := c.conn.SetDeadline(d); err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { c.conn.SetDeadline(time.Unix(1, 0)) })
	return func() { stop() }, nil
}

// readWithFD reads one reply line straight from the socket, with the descriptor that came with
// it (-1: none).
func (c *Client) readWithFD(max int) ([]byte, int, error) {
	uc, ok := c.conn.(*net.UnixConn)
	if !ok {
		return nil, -1, errors.New("not a Unix socket connection")
	}
	fd := -1
	var buf []byte
	tmp := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for {
		n, oobn, _, _, err := uc.ReadMsgUnix(tmp, oob)
		if oobn > 0 {
			msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				fds, ferr := unix.ParseUnixRights(&m)
				for _, x := range fds {
					if fd < 0 && ferr == nil && perr == nil {
						fd = x
					} else {
						unix.Close(x)
					}
				}
			}
		}
		buf = append(buf, tmp[:n]...)
		if i := bytes.IndexByte(buf, '\n'); i >= 0 {
			if i != len(buf)-1 {
				err = fmt.Errorf("%w: bytes after the reply", ErrProtocol)
			}
			if err != nil {
				if fd >= 0 {
					unix.Close(fd)
				}
				return nil, -1, err
			}
			return buf, fd, nil
		}
		if err == nil && n == 0 {
			err = io.EOF
		}
		if err == nil && len(buf) > max {
			err = fmt.Errorf("%w: reply longer than %d bytes", ErrProtocol, max)
		}
		if err != nil {
			if fd >= 0 {
				unix.Close(fd)
			}
			return nil, -1, err
		}
	}
}

// Slot returns slot k of the ring.
func (s *MemSession) Slot(k int) []byte {
	n := int(s.Begin.ChunkBytes)
	return s.ring[k*n : (k+1)*n]
}

func (s *MemSession) send(v any) error {
	line, _ := json.Marshal(v)
	s.wmu.Lock()
	defer s.wmu.Unlock()
	_, err := s.c.conn.Write(append(line, '\n'))
	return err
}

type memMsg struct {
	OK    *bool  `json:"ok"`
	Chunk *int64 `json:"chunk"`
	Slot  *int   `json:"slot"`
	Len   *int64 `json:"len"`
	Free  *int   `json:"free"`
}

// readMsg reads one line of a transfer: a progress message, or (ok set) the final reply.
func (s *MemSession) readMsg() (memMsg, []byte, error) {
	line, err := readLine(s.c.r, 1<<20)
	if err != nil {
		return memMsg{}, nil, err
	}
	var m memMsg
	if err := json.Unmarshal(line, &m); err != nil {
		return memMsg{}, nil, fmt.Errorf("%w: %v", ErrProtocol, err)
	}
	return m, line, nil
}

func (s *MemSession) final(cmd string, line []byte) (*MemCopied, error) {
	res, _, err := parseReply(cmd, line)
	if err != nil {
		return nil, err
	}
	var r MemCopied
	if err := json.Unmarshal(res, &r); err != nil {
		return nil, fmt.Errorf("%s: %w: %v", cmd, ErrProtocol, err)
	}
	return &r, nil
}

// Copy (save) has the shim copy every chunk not in skip (indexed over all regions, in order)
// into the ring, in order; chunk is called for each with the slot's bytes and a release to call
// (from any goroutine) once they are no longer needed. chunk must not block on a later chunk.
func (s *MemSession) Copy(ctx context.Context, skip []bool, chunk func(c int64, data []byte, release func()) error) (*MemCopied, error) {
	b := s.Begin
	if b.Dir != "save" {
		return nil, errors.New("mem-copy: not a save session")
	}
	req := map[string]any{"cmd": "mem-copy"}
	if len(skip) > 0 {
		if int64(len(skip)) != b.Chunks {
			return nil, fmt.Errorf("mem-copy: %d skip flags for %d chunks", len(skip), b.Chunks)
		}
		req["skip"] = skipHex(skip)
	}
	stop, err := s.c.deadline(ctx, 30*time.Minute)
	if err != nil {
		return nil, err
	}
	defer stop()
	if err := s.send(req); err != nil {
		return nil, fmt.Errorf("mem-copy: send: %w", err)
	}
	held := make([]bool, b.Slots)
	var hmu sync.Mutex
	next := int64(0)
	for {
		m, line, err := s.readMsg()
		if err != nil {
			return nil, fmt.Errorf("mem-copy: %w", err)
		}
		if m.OK != nil {
			return s.final("mem-copy", line)
		}
		if m.Chunk == nil || m.Slot == nil || m.Len == nil || *m.Slot < 0 || *m.Slot >= b.Slots || *m.Chunk < next ||
			*m.Chunk >= b.Chunks || (len(skip) > 0 && skip[*m.Chunk]) || *m.Len <= 0 || *m.Len > b.ChunkBytes {
			return nil, fmt.Errorf("mem-copy: %w: bad chunk message %s", ErrProtocol, bytes.TrimSpace(line))
		}
		k := *m.Slot
		hmu.Lock()
		busy := held[k]
		held[k] = true
		hmu.Unlock()
		if busy {
			return nil, fmt.Errorf("mem-copy: %w: slot %d handed over twice", ErrProtocol, k)
		}
		next = *m.Chunk + 1
		var once sync.Once
		release := func() {
			once.Do(func() {
				hmu.Lock()
				held[k] = false
				hmu.Unlock()
				s.send(map[string]int{"free": k}) // a failure surfaces in the copy's reply
			})
		}
		if err := chunk(*m.Chunk, s.Slot(k)[:*m.Len], release); err != nil {
			return nil, err
		}
	}
}

func skipHex(skip []bool) string {
	out := make([]byte, (len(skip)+3)/4)
	for i, s := range skip {
		if s {
			out[i/4] |= 1 << (i % 4)
		}
	}
	for i, v := range out {
		out[i] = "0123456789abcdef"[v]
	}
	return string(out)
}

// Fill (load) sends every chunk, in order, to the shim, which copies it to the device: fill is
// called with a free slot and chunk c's expected length, and must fill the slot's first n bytes.
func (s *MemSession) Fill(ctx context.Context, fill func(c int64, slot []byte) error) (*MemCopied, error) {
	b := s.Begin
	if b.Dir != "load" {
		return nil, errors.New("mem-fill: not a load session")
	}
	stop, err := s.c.deadline(ctx, 30*time.Minute)
	if err != nil {
		return nil, err
	}
	defer stop()
	if err := s.send(map[string]string{"cmd": "mem-fill"}); err != nil {
		return nil, fmt.Errorf("mem-fill: send: %w", err)
	}
	free := make([]int, 0, b.Slots)
	for k := b.Slots - 1; k >= 0; k-- {
		free = append(free, k)
	}
	busy := make([]bool, b.Slots)
	take := func(m memMsg, line []byte) error {
		if m.Free == nil || *m.Free < 0 || *m.Free >= b.Slots || !busy[*m.Free] {
			return fmt.Errorf("mem-fill: %w: unexpected message %s", ErrProtocol, bytes.TrimSpace(line))
		}
		busy[*m.Free] = false
		free = append(free, *m.Free)
		return nil
	}
	var c int64
	for _, r := range b.Regions {
		for k := range r.Chunks(b.ChunkBytes) {
			for len(free) == 0 {
				m, line, err := s.readMsg()
				if err != nil {
					return nil, fmt.Errorf("mem-fill: %w", err)
				}
				if m.OK != nil {
					_, err := s.final("mem-fill", line)
					return nil, fmt.Errorf("mem-fill: the shim ended early: %w", err)
				}
				if err := take(m, line); err != nil {
					return nil, err
				}
			}
			slot := free[len(free)-1]
			free = free[:len(free)-1]
			n := min(b.ChunkBytes, int64(r.Bytes)-k*b.ChunkBytes)
			if err := fill(c, s.Slot(slot)[:n]); err != nil {
				return nil, err
			}
			busy[slot] = true
			if err := s.send(map[string]int64{"chunk": c, "slot": int64(slot), "len": n}); err != nil {
				return nil, fmt.Errorf("mem-fill: send: %w", err)
			}
			c++
		}
	}
	if err := s.send(map[string]int64{"end": c}); err != nil {
		return nil, fmt.Errorf("mem-fill: send: %w", err)
	}
	for {
		m, line, err := s.readMsg()
		if err != nil {
			return nil, fmt.Errorf("mem-fill: %w", err)
		}
		if m.OK != nil {
			return s.final("mem-fill", line)
		}
		if err := take(m, line); err != nil {
			return nil, err
		}
	}
}

// Close ends the session: the shim drops its ring, this side unmaps it.
func (s *MemSession) Close(ctx context.Context) error {
	var err error
	if s.c != nil {
		_, err = s.c.Raw(ctx, "mem-end", nil)
	}
	if s.ring != nil {
		unix.Munmap(s.ring)
		s.ring = nil
	}
	return err
}
