// Package devmem moves the device memory a process's shim owns (ptxmig run --owned-memory) into
// an image at checkpoint and back at restore, through the shim's ring (shimctl.MemSession):
// chunks unchanged since the previous image of the same process (same GPU hash, chunk still in
// the store) are recorded by reference and never copied; the others go straight into the store's
// ingest. The format is in docs/FORMAT.md, "Owned device memory".
package devmem

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/ptxmig/ptxmig/internal/imagedesc"
	"github.com/ptxmig/ptxmig/internal/shimctl"
	"github.com/ptxmig/ptxmig/store"
)

// IndexVersion is the version of the index this package writes and reads.
const IndexVersion = 1

// ExtraKey is the legacy image metadata key listing "pid:instance" of every process whose owned
// memory the image holds (space-separated): a later checkpoint of the same process finds its
// previous image by it. Images record it as imagedesc.Description.Devmem now.
const ExtraKey = imagedesc.ExtraDevmem

// Limits on what an index may say (it is read from an image).
const (
	maxRegions    = 1 << 20
	maxBytes      = 1 << 46
	maxIndexBytes = 64 << 20
)

// IndexName is the image file that describes pid's owned memory; DataName holds region i's bytes.
func IndexName(pid int) string   { return fmt.Sprintf("ptxmig-devmem-%d.json", pid) }
func DataName(pid, i int) string { return fmt.Sprintf("ptxmig-devmem-%d-%d.bin", pid, i) }

// IsData reports whether an image file holds owned device memory (read when it is loaded, not
// before).
func IsData(name string) bool {
	return strings.HasPrefix(name, "ptxmig-devmem-") && strings.HasSuffix(name, ".bin")
}

// Index describes one process's owned memory in an image.
type Index struct {
	Version    int      `json:"version"`
	PID        int      `json:"pid"`
	Instance   string   `json:"instance"`
	ChunkBytes int64    `json:"chunk_bytes"`
	Hash       string   `json:"hash,omitempty"` // the chunk hash of Regions' Hashes ("ptxmig-gpuhash-1")
	Regions    []Region `json:"regions"`
}

// Region is one owned allocation: Bytes of it are in File.
type Region struct {
	VA     uint64 `json:"va"`
	Size   uint64 `json:"size"`
	Asked  uint64 `json:"asked"`
	Bytes  uint64 `json:"bytes"`
	Device int    `json:"device"`
	File   string `json:"file"`
	Hashes string `json:"hashes,omitempty"` // 32 hex digits per chunk
}

// Bytes is the total of the regions' bytes.
func (x *Index) Bytes() int64 {
	var n int64
	for _, r := range x.Regions {
		n += int64(r.Bytes)
	}
	return n
}

// ParseIndex decodes and checks an index read from an image.
func ParseIndex(b []byte) (*Index, error) {
	var x Index
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&x); err != nil {
		return nil, fmt.Errorf("owned-memory index: %w", err)
	}
	if err := x.check(); err != nil {
		return nil, fmt.Errorf("owned-memory index: %w", err)
	}
	return &x, nil
}

func (x *Index) check() error {
	switch {
	case x.Version != IndexVersion:
		return fmt.Errorf("version %d, this ptxmig reads %d", x.Version, IndexVersion)
	case x.PID <= 0:
		return fmt.Errorf("pid %d", x.PID)
	case len(x.Instance) != 16 || !isHex(x.Instance):
		return fmt.Errorf("instance %q", x.Instance)
	case x.ChunkBytes < store.MinChunkSize || x.ChunkBytes > store.MaxChunkSize || x.ChunkBytes%256 != 0:
		return fmt.Errorf("chunk size %d", x.ChunkBytes)
	case len(x.Regions) > maxRegions:
		return fmt.Errorf("%d regions", len(x.Regions))
	case x.Hash != "" && x.Hash != "ptxmig-gpuhash-1":
		return fmt.Errorf("unknown hash %q", x.Hash)
	}
	var end uint64
	for i, r := range x.Regions {
		switch {
		case r.VA == 0 || r.VA < end || r.Size == 0 || r.Size > maxBytes || r.VA+r.Size < r.VA:
			return fmt.Errorf("region %d: range %#x+%d", i, r.VA, r.Size)
		case r.Asked == 0 || r.Asked > r.Bytes || r.Bytes > r.Size:
			return fmt.Errorf("region %d: bytes %d asked %d size %d", i, r.Bytes, r.Asked, r.Size)
		case r.File != DataName(x.PID, i):
			return fmt.Errorf("region %d: file %q, want %q", i, r.File, DataName(x.PID, i))
		case r.Device < 0 || r.Device > 1024:
			return fmt.Errorf("region %d: device %d", i, r.Device)
		case r.Hashes != "" && (x.Hash == "" || int64(len(r.Hashes)) != 32*chunks(r.Bytes, x.ChunkBytes) || !isHex(r.Hashes)):
			return fmt.Errorf("region %d: %d hash digits", i, len(r.Hashes))
		}
		end = r.VA + r.Size
	}
	return nil
}

func isHex(s string) bool {
	_, err := hex.DecodeString(s)
	return err == nil && strings.ToLower(s) == s
}

func chunks(bytes uint64, chunk int64) int64 {
	return int64((bytes + uint64(chunk) - 1) / uint64(chunk))
}

// EncodeExtra and DecodeExtra write and read the legacy ExtraKey value.
func EncodeExtra(m map[int]string) string { return imagedesc.EncodeDevmemLegacy(m) }

func DecodeExtra(s string) map[int]string { return imagedesc.DecodeDevmemLegacy(s) }

// Sink is where a save writes: the checkpoint's store ingest.
type Sink interface {
	AddChunks(path string, mode uint32, next func() (store.ChunkPiece, bool, error)) (int64, error)
	AddFile(path string, mode uint32, r io.Reader) (int64, error)
	HasChunk(c store.Chunk) bool
	ChunkSize() int
}

// Source reads a saved file back: an image of the store (restore) or the checkpoint's ingest
// (a rollback).
type Source = store.FileWriter

// Prev is the previous image of the process: its index and the chunks of its data files.
type Prev struct {
	Image string
	Index *Index
	Files map[string]*store.File
}

// FindPrev returns the newest image of ms holding owned memory of pid with this instance (nil:
// none), reading its index through read.
func FindPrev(ms []*store.Manifest, pid int, instance string, read func(m *store.Manifest, name string) ([]byte, error)) *Prev {
	var best *store.Manifest
	for _, m := range ms {
		// Only the processes it lists matter here: an image whose other fields are invalid still
		// names them (and its chunks are checked like any).
		if d, _ := imagedesc.Read(m); d.Devmem[pid] != instance {
			continue
		}
		if best == nil || m.Created.After(best.Created) {
			best = m
		}
	}
	if best == nil {
		return nil
	}
	b, err := read(best, IndexName(pid))
	if err != nil {
		return nil
	}
	x, err := ParseIndex(b)
	if err != nil || x.Instance != instance {
		return nil
	}
	p := &Prev{Image: best.Name, Index: x, Files: map[string]*store.File{}}
	for i := range best.Files {
		if f := &best.Files[i]; strings.HasPrefix(f.Path, "ptxmig-devmem-") {
			p.Files[f.Path] = f
		}
	}
	return p
}

// SaveReport says what a save moved.
type SaveReport struct {
	PID          int           `json:"pid"`
	Instance     string        `json:"instance"`
	Regions      int           `json:"regions"`
	OwnedBytes   int64         `json:"owned_bytes"`   // the regions' bytes
	CopiedBytes  int64         `json:"copied_bytes"`  // copied out of the GPU
	SkippedBytes int64         `json:"skipped_bytes"` // unchanged since Prev: recorded by reference
	Chunks       int64         `json:"chunks"`
	Skipped      int64         `json:"skipped_chunks"`
	Prev         string        `json:"prev_image,omitempty"`
	Pinned       bool          `json:"pinned"`
	Sync         time.Duration `json:"sync_ns"` // the shim waited for the process's GPU work
	Hash         time.Duration `json:"hash_ns"` // GPU hashing
	Copy         time.Duration `json:"copy_ns"` // copy into the store (hashing, compression included)
	// Of Copy, the shim's waits: for the GPU's copies, and for ptxmig to give slots back (the store).
	GPUWait  time.Duration `json:"gpu_wait_ns"`
	PeerWait time.Duration `json:"peer_wait_ns"`
	Release  time.Duration `json:"release_ns,omitempty"`
}

// Throughput is the copy's bytes per second.
func (r *SaveReport) Throughput() float64 {
	if r.Copy <= 0 {
		return 0
	}
	return float64(r.CopiedBytes) / r.Copy.Seconds()
}

type piece struct {
	c       int64
	data    []byte
	release func()
}

// Save copies the session's regions into sink (which must use the session's chunk size) and
// adds the index; chunks whose GPU hash equals prev's for the same region are referenced.
func Save(ctx context.Context, sess *shimctl.MemSession, pid int, sink Sink, prev *Prev) (*Index, *SaveReport, error) {
	b := sess.Begin
	if int64(sink.ChunkSize()) != b.ChunkBytes {
		return nil, nil, fmt.Errorf("owned memory of pid %d: session chunk %d, store chunk %d", pid, b.ChunkBytes, sink.ChunkSize())
	}
	x := &Index{Version: IndexVersion, PID: pid, Instance: b.Instance, ChunkBytes: b.ChunkBytes, Hash: b.Hash}
	rep := &SaveReport{PID: pid, Instance: b.Instance, Regions: len(b.Regions), Chunks: b.Chunks, Pinned: b.Pinned,
		Sync: time.Duration(b.SyncUS) * time.Microsecond, Hash: time.Duration(b.HashUS) * time.Microsecond}
	skip := make([]bool, b.Chunks)
	refs := make([]*store.Chunk, b.Chunks)
	usable := prev != nil && prev.Index.Instance == b.Instance && prev.Index.ChunkBytes == b.ChunkBytes && b.Hash != "" && prev.Index.Hash == b.Hash
	var c int64
	for i, r := range b.Regions {
		x.Regions = append(x.Regions, Region{VA: r.VA, Size: r.Size, Asked: r.Asked, Bytes: r.Bytes, Device: r.Device, File: DataName(pid, i), Hashes: r.Hashes})
		rep.OwnedBytes += int64(r.Bytes)
		var old *Region
		var oldFile *store.File
		if usable {
			for j := range prev.Index.Regions {
				if pr := &prev.Index.Regions[j]; pr.VA == r.VA && pr.Bytes == r.Bytes && pr.Hashes != "" {
					old, oldFile = pr, prev.Files[pr.File]
				}
			}
		}
		n := r.Chunks(b.ChunkBytes)
		for k := range n {
			if old != nil && oldFile != nil && int64(len(oldFile.Chunks)) == n && old.Hashes[32*k:32*k+32] == r.ChunkHash(k) {
				ch := oldFile.Chunks[k]
				if want := min(b.ChunkBytes, int64(r.Bytes)-k*b.ChunkBytes); int64(ch.Size) == want && sink.HasChunk(ch) {
					skip[c+k], refs[c+k] = true, &ch
					rep.Skipped++
					rep.SkippedBytes += want
				}
			}
		}
		c += n
	}
	if rep.Skipped > 0 {
		rep.Prev = prev.Image
	}
	// One goroutine adds the regions' files in order; the copy hands it the chunks in order.
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch := make(chan piece, b.Slots)
	done := make(chan struct{})
	var addErr error
	go func() {
		defer close(done)
		var c int64
		for i, r := range b.Regions {
			n := r.Chunks(b.ChunkBytes)
			end := c + n
			_, err := sink.AddChunks(DataName(pid, i), 0o600, func() (store.ChunkPiece, bool, error) {
				if c == end {
					return store.ChunkPiece{}, false, nil
				}
				if skip[c] {
					ref := refs[c]
					c++
					return store.ChunkPiece{Ref: ref}, true, nil
				}
				select {
				case p := <-ch:
					if p.c != c {
						p.release()
						return store.ChunkPiece{}, false, fmt.Errorf("owned memory: chunk %d arrived, expected %d", p.c, c)
					}
					c++
					return store.ChunkPiece{Data: p.data, Release: p.release}, true, nil
				case <-actx.Done():
					return store.ChunkPiece{}, false, actx.Err()
				}
			})
			if err != nil {
				addErr = fmt.Errorf("store owned memory region %d of pid %d: %w", i, pid, err)
				return
			}
			c = end
		}
	}()
	t0 := time.Now()
	// Each chunk is copied out of its slot at once and the slot given back: the shim copies the
	// next chunk while the store works, whose pace (the disk's) then sets the copy's, not the
	// ring's size.
	bufs := sync.Pool{New: func() any { b := make([]byte, b.ChunkBytes); return &b }}
	res, err := sess.Copy(ctx, skip, func(c int64, data []byte, release func()) error {
		bp := bufs.Get().(*[]byte)
		own := append((*bp)[:0], data...)
		release()
		p := piece{c, own, func() { *bp = own[:0]; bufs.Put(bp) }}
		select {
		case ch <- p:
			return nil
		case <-done:
			p.release()
			return errors.New("the store stopped taking chunks")
		}
	})
	if err != nil {
		cancel() // the adder may wait for a chunk that never comes
		<-done
		if addErr != nil && !errors.Is(addErr, context.Canceled) {
			return nil, nil, errors.Join(addErr, err)
		}
		return nil, nil, fmt.Errorf("copy owned memory of pid %d: %w", pid, err)
	}
	<-done
	rep.Copy = time.Since(t0)
	if addErr != nil {
		return nil, nil, addErr
	}
	rep.CopiedBytes = res.Bytes
	rep.GPUWait, rep.PeerWait = time.Duration(res.GPUWaitUS)*time.Microsecond, time.Duration(res.PeerWaitUS)*time.Microsecond
	if res.Skipped != rep.Skipped {
		return nil, nil, fmt.Errorf("copy owned memory of pid %d: the shim skipped %d chunks, %d asked", pid, res.Skipped, rep.Skipped)
	}
	js, _ := json.MarshalIndent(x, "", " ")
	if _, err := sink.AddFile(IndexName(pid), 0o600, bytes.NewReader(js)); err != nil {
		return nil, nil, fmt.Errorf("store owned memory index of pid %d: %w", pid, err)
	}
	return x, rep, nil
}

// LoadReport says what a load moved.
type LoadReport struct {
	PID   int           `json:"pid"`
	Bytes int64         `json:"bytes"`
	Remap time.Duration `json:"remap_ns"` // the shim re-created the physical memory
	Copy  time.Duration `json:"copy_ns"`  // from the store into the GPU (decompression, verification included)
	// Of Copy, the time the shim waited for ptxmig's next chunk (reading the store).
	PeerWait time.Duration `json:"peer_wait_ns"`
	Pinned   bool          `json:"pinned"`
}

// Load copies the regions of x from src into the session's (re-created) memory. The session's
// regions must be x's.
func Load(ctx context.Context, sess *shimctl.MemSession, x *Index, src Source) (*LoadReport, error) {
	b := sess.Begin
	if b.ChunkBytes != x.ChunkBytes || len(b.Regions) != len(x.Regions) {
		return nil, fmt.Errorf("load owned memory of pid %d: the process has %d regions (chunk %d), the image %d (chunk %d)",
			x.PID, len(b.Regions), b.ChunkBytes, len(x.Regions), x.ChunkBytes)
	}
	for i, r := range b.Regions {
		if o := x.Regions[i]; o.VA != r.VA || o.Size != r.Size || o.Bytes != r.Bytes {
			return nil, fmt.Errorf("load owned memory of pid %d: region %d is %#x+%d in the process, %#x+%d in the image", x.PID, i, r.VA, r.Bytes, o.VA, o.Bytes)
		}
	}
	rep := &LoadReport{PID: x.PID, Remap: time.Duration(b.RemapUS) * time.Microsecond, Pinned: b.Pinned}
	t0 := time.Now()
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	region, left := -1, int64(0)
	var pr *io.PipeReader
	var werr chan error
	finish := func() error {
		if pr == nil {
			return nil
		}
		// The file must end where the region ends.
		var one [1]byte
		if n, _ := pr.Read(one[:]); n > 0 {
			pr.Close()
			return fmt.Errorf("%s is longer than its region", x.Regions[region].File)
		}
		pr.Close()
		return <-werr
	}
	open := func(i int) {
		r, w := io.Pipe()
		pr, werr = r, make(chan error, 1)
		name := x.Regions[i].File
		go func() {
			n, err := src.WriteFile(cctx, name, w)
			if err == nil && n != int64(x.Regions[i].Bytes) {
				err = fmt.Errorf("%s holds %d bytes, its region %d", name, n, x.Regions[i].Bytes)
			}
			w.CloseWithError(err)
			werr <- err
		}()
	}
	res, err := sess.Fill(ctx, func(c int64, slot []byte) error {
		for left == 0 {
			if err := finish(); err != nil {
				return err
			}
			region++
			if region >= len(x.Regions) {
				return fmt.Errorf("chunk %d past the last region", c)
			}
			left = int64(x.Regions[region].Bytes)
			open(region)
		}
		if _, err := io.ReadFull(pr, slot); err != nil {
			return fmt.Errorf("read %s: %w", x.Regions[region].File, err)
		}
		left -= int64(len(slot))
		rep.Bytes += int64(len(slot))
		return nil
	})
	if err == nil {
		err = finish()
	} else if pr != nil {
		pr.CloseWithError(err)
	}
	if err != nil {
		return nil, fmt.Errorf("load owned memory of pid %d: %w", x.PID, err)
	}
	rep.Copy = time.Since(t0)
	rep.PeerWait = time.Duration(res.PeerWaitUS) * time.Microsecond
	return rep, nil
}

// ReadIndexBytes reads an index file from src, at most maxIndexBytes of it.
func ReadIndexBytes(ctx context.Context, src Source, name string) ([]byte, error) {
	return store.ReadFileLimit(ctx, src, name, maxIndexBytes)
}

// ReadIndex reads pid's index from src (nil, nil: the image has none).
func ReadIndex(ctx context.Context, src Source, has func(string) bool, pid int) (*Index, error) {
	if !has(IndexName(pid)) {
		return nil, nil
	}
	b, err := ReadIndexBytes(ctx, src, IndexName(pid))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", IndexName(pid), err)
	}
	x, err := ParseIndex(b)
	if err != nil {
		return nil, err
	}
	if x.PID != pid {
		return nil, fmt.Errorf("%s is the index of pid %d", IndexName(pid), x.PID)
	}
	return x, nil
}
