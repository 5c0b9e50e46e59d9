package store

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
)

// CheckChunkFiles checks, without reading them, that every chunk file the image m references is
// there and has the size the manifest recorded: a regular file (never followed through a
// symlink) of a header and 1 to Size payload bytes, and of exactly the chunk's Stored bytes
// (the chunk file's size when the image was written). It costs one lstat(2) per distinct chunk,
// so an operation can refuse a truncated or missing chunk before it starts (restore's preflight)
// instead of failing part-way.
//
// A size other than Stored is not proof on its own: the image may have been imported into a store
// that already held the same chunk, encoded by another ptxmig (another size, the same bytes). Such
// a chunk, and only such a one, is read and verified (decoded, its hash checked). Errors wrap
// ErrCorrupt and name the chunk, its file and the first file and offset of the image using it.
// It holds the store lock shared while it checks.
func (s *Store) CheckChunkFiles(ctx context.Context, m *Manifest) error {
	lk, err := s.lockShared(ctx)
	if err != nil {
		return err
	}
	defer lk.unlock()
	uses, order := sortedUses(m)
	var dec *chunkDecoder
	var bufs chunkBufs
	defer func() {
		if dec != nil {
			dec.close()
		}
	}()
	for i, id := range order {
		if i%1024 == 0 {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("check chunks of image %s: %w", m.Name, err)
			}
		}
		u := uses[id][0]
		size, stored := u.ch.Size, 0
		for _, v := range uses[id] {
			if v.ch.Size != size {
				return fmt.Errorf("image %s: %w: chunk %s listed with sizes %d and %d", m.Name, ErrCorrupt, id, size, v.ch.Size)
			}
			if stored == 0 {
				stored = v.ch.Stored
			}
		}
		p := s.chunkPath(id)
		bad := func(format string, a ...any) error {
			return fmt.Errorf("image %s: %w: chunk %s (%s at offset %d), file %s: %s", m.Name, ErrCorrupt, id, u.file.Path, u.ch.Offset, p, fmt.Sprintf(format, a...))
		}
		fi, err := os.Lstat(p)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return bad("missing")
		case err != nil:
			return fmt.Errorf("image %s: chunk %s: %w", m.Name, id, err)
		case !fi.Mode().IsRegular():
			return bad("not a regular file (%v)", fi.Mode().Type())
		}
		n := fi.Size()
		if n <= chunkHeaderLen || n > chunkHeaderLen+int64(maxEncodedLen(size)) {
			return bad("%d bytes, but a chunk of %d bytes takes %d to %d (truncated?)", n, size, chunkHeaderLen+1, chunkHeaderLen+maxEncodedLen(size))
		}
		if stored == 0 || n == int64(stored) {
			continue
		}
		if dec == nil {
			if dec, err = newChunkDecoder(1, maxChunkOf(m)); err != nil {
				return err
			}
		}
		bufs.file, err = s.readChunkFile(id, size, dec.fileBuf(&bufs))
		if err == nil {
			_, err = dec.decode(bufs.file, id, size, &bufs)
		}
		if err != nil {
			why := strings.TrimPrefix(err.Error(), fmt.Sprintf("%v: chunk %s: ", ErrCorrupt, id))
			return bad("%d bytes, %d when the image was written (truncated?), and it does not verify: %s", n, stored, why)
		}
	}
	return nil
}
