package store

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// chunkStage collects the chunk files one writer (Put or Import) creates. Each is written to a
// temp file in tmp/ and closed at once, without a sync of its own; commit then makes all of them
// durable with one syncfs(2), renames them into chunks/, and makes the renames durable with a
// second syncfs. So a chunk file never appears under its final name before its contents are on
// disk, which is what deduplication relies on: any regular file chunks/XX/HASH is trusted.
//
// The second syncfs also covers chunks the writer did not write but found under their final
// names (deduplicated): one renamed by a concurrent writer that has not reached its own second
// syncfs yet is made durable by ours, since its rename happened before our lookup. So every
// chunk a manifest references is durable before the manifest is written.
//
// The writer holds the store lock shared from before its first temp file until after commit or
// close, and gc (which removes temp files) needs it exclusively, so staged files cannot vanish.
type chunkStage struct {
	s  *Store
	fs *os.File // the store directory, opened before any temp file: syncfs reports writeback
	// errors that happened since this fd was opened (Linux ≥ 5.8)

	mu     sync.Mutex
	staged []stagedChunk
	found  bool // a referenced chunk was found already under its final name
}

type stagedChunk struct {
	tmp string
	id  ChunkID
}

func (s *Store) newChunkStage() (*chunkStage, error) {
	f, err := os.OpenFile(s.dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("open store for syncfs: %w", err)
	}
	return &chunkStage{s: s, fs: f}, nil
}

// add writes an encoded chunk file to a temp file and closes it. The caller has checked that
// chunks/ does not hold id yet; if another writer renames the same id first, both renames put
// identical content in place.
func (cs *chunkStage) add(id ChunkID, data []byte) error {
	f, err := os.CreateTemp(cs.s.tmpDir(), "c-*")
	if err != nil {
		return fmt.Errorf("write chunk %s: %w", id, err)
	}
	tmp := f.Name()
	_, err = f.Write(data)
	if err == nil && !syncfsReportsErrors() {
		// This kernel's syncfs does not report writeback errors: sync each file as it is written.
		err = unix.Fdatasync(int(f.Fd()))
	} else if err == nil {
		// Start writeback now, without waiting: the disk works while later chunks are encoded,
		// and commit's syncfs finds less to flush. Only a hint; errors surface at syncfs.
		_ = unix.SyncFileRange(int(f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write chunk %s: %w", id, err)
	}
	cs.mu.Lock()
	cs.staged = append(cs.staged, stagedChunk{tmp: tmp, id: id})
	cs.mu.Unlock()
	return nil
}

// keepOnly deletes the staged temp files of chunks not in used (a Prestage staged content the
// writer later replaced): only referenced chunks are published.
func (cs *chunkStage) keepOnly(used map[ChunkID]bool) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	kept := cs.staged[:0]
	for _, t := range cs.staged {
		if used[t.id] {
			kept = append(kept, t)
		} else {
			os.Remove(t.tmp)
		}
	}
	cs.staged = kept
}

// found records that the writer references a chunk it found under its final name instead of
// writing it; that chunk's rename may be a concurrent writer's, not yet durable.
func (cs *chunkStage) markFound() {
	cs.mu.Lock()
	cs.found = true
	cs.mu.Unlock()
}

// syncfs flushes the whole filesystem holding the store: data, inodes and directory entries.
func (cs *chunkStage) syncfs() error {
	if err := unix.Syncfs(int(cs.fs.Fd())); err != nil {
		return fmt.Errorf("syncfs %s: %w", cs.s.dir, err)
	}
	return nil
}

// commit makes the staged chunks durable, renames them into place and makes the renames (and
// those of chunks marked found) durable. Call it once, after the last add. With nothing staged
// or found (an image of zeros and symlinks), there is nothing to sync.
func (cs *chunkStage) commit() error {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if len(cs.staged) == 0 && !cs.found {
		return nil
	}
	if len(cs.staged) > 0 {
		if err := cs.syncfs(); err != nil {
			return fmt.Errorf("sync chunks: %w", err)
		}
	}
	if err := cs.publishLocked(len(cs.staged)); err != nil {
		return err
	}
	if err := cs.syncfs(); err != nil {
		return fmt.Errorf("sync chunk renames: %w", err)
	}
	return nil
}

// publishLocked renames the first n staged chunks into place; only after a syncfs.
func (cs *chunkStage) publishLocked(n int) error {
	for i := range n {
		t := cs.staged[i]
		if err := os.Rename(t.tmp, cs.s.chunkPath(t.id)); err != nil {
			cs.staged = cs.staged[i:]
			return fmt.Errorf("write chunk %s: %w", t.id, err)
		}
	}
	cs.staged = cs.staged[n:]
	return nil
}

// close removes the temp files not renamed (after a failure) and the directory fd.
func (cs *chunkStage) close() {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	for _, t := range cs.staged {
		os.Remove(t.tmp)
	}
	cs.staged = nil
	cs.fs.Close()
}

// syncfsReportsErrors tells whether syncfs(2) returns writeback errors, which Linux does from
// 5.8 on; before, an I/O error writing a temp file could go unnoticed, so each file is synced.
var syncfsReportsErrors = sync.OnceValue(func() bool {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return false
	}
	return kernelAtLeast(unix.ByteSliceToString(u.Release[:]), 5, 8)
})

// kernelAtLeast parses a release string such as "6.8.0-45-generic" and compares it with
// major.minor; an unparsable release counts as older.
func kernelAtLeast(release string, major, minor int) bool {
	parts := strings.SplitN(release, ".", 3)
	if len(parts) < 2 {
		return false
	}
	ma, err := strconv.Atoi(parts[0])
	if err != nil {
		return false
	}
	mi := parts[1]
	if i := strings.IndexFunc(mi, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		mi = mi[:i]
	}
	mn, err := strconv.Atoi(mi)
	if err != nil {
		return false
	}
	return ma > major || (ma == major && mn >= minor)
}
