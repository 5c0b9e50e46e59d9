package store

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/zeebo/blake3"
)

// Manifest authentication (format 1.1, docs/FORMAT.md "Authentication").
//
// A sealed manifest is the content encoding (format_version … files) followed by two members the
// writer appends:
//
//	"auth": the authentication index: a short check of every member of the content, of every
//	        member of meta, of every key of meta.extra, of every member of every file entry and of
//	        every chunk entry; only used to name what changed
//	"id":   64 hex digits, the image id: the BLAKE3-256 of the file's bytes with these 64 digits
//	        read as ASCII '0'
//
// The id is the last member, so the file ends with `,"id":"<64 hex>"}` and a newline. It covers
// every byte of the file, the index included; every reader recomputes it (DecodeManifest), and
// when it differs the index tells which field was edited. Older manifests (format 1.0) carry
// neither: their id is the hash of the file's bytes, which nothing stored can be checked against.

const (
	idTail      = `,"id":"`
	idTailLen   = len(idTail) + 64 + len(`"}`) + 1 // the sealed file's last bytes
	memberCheck = 4                                // bytes of a top, meta or extra member's check
	entryCheck  = 2                                // bytes of a file entry member's or chunk's check
	entryWidth  = 2 * entryCheck                   // hex digits of one such check
	absent      = "----"                           // a file entry member that is not there
)

// fileMembers are the members of a file entry that have their own check in the index, in the
// order of their checks; the seventh check covers every other member together.
var fileMembers = [...]string{"path", "type", "mode", "size", "target", "chunks"}

const otherMembers = len(fileMembers) // position of the check of a file entry's other members

var zeroID = bytes.Repeat([]byte{'0'}, 64)

// authIndex is the "auth" member of a sealed manifest. Each file entry's index is a string:
// seven checks (fileMembers, then the other members together; absent for a missing member), then,
// when the entry has chunks, "|" and one check per chunk entry.
type authIndex struct {
	Alg string `json:"alg"`
	// Check is the check of the index itself (encoded with Check empty), so an edited index is
	// told apart from an edited field.
	Check string            `json:"check"`
	Top   map[string]string `json:"top"`
	Meta  map[string]string `json:"meta,omitempty"`
	Extra map[string]string `json:"extra,omitempty"`
	Files []string          `json:"files"`
}

// ManifestMismatchError is a sealed manifest that does not hash to the id it carries: it was
// edited or damaged after it was written. Changes names what differs from the manifest's
// authentication index ("created", "meta.host", `files["core.img"].mode`,
// `files["pages-1.img"].chunks[3] (offset 12582912)` …). It wraps ErrCorrupt.
type ManifestMismatchError struct {
	ID      string   // the id the manifest carries
	Changes []string // what differs, in manifest order; never empty
}

func (e *ManifestMismatchError) Error() string {
	const show = 8
	var b strings.Builder
	fmt.Fprintf(&b, "%v: manifest does not match its id %.16s…: ", ErrCorrupt, e.ID)
	for i, c := range e.Changes {
		if i == show {
			fmt.Fprintf(&b, "; and %d more", len(e.Changes)-show)
			break
		}
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(c)
	}
	return b.String()
}

func (e *ManifestMismatchError) Unwrap() error { return ErrCorrupt }

func check(raw []byte, n int) string {
	sum := blake3.Sum256(raw)
	return hex.EncodeToString(sum[:n])
}

// sealManifest appends the authentication index and the id to a content encoding (one JSON
// object, no trailing newline) and returns the sealed file and its id. It does not validate.
func sealManifest(content []byte) ([]byte, string, error) {
	if len(content) < 2 || content[0] != '{' || content[len(content)-1] != '}' {
		return nil, "", fmt.Errorf("seal manifest: not a JSON object")
	}
	top, err := splitObject(content)
	if err != nil {
		return nil, "", fmt.Errorf("seal manifest: %w", err)
	}
	if len(top) == 0 {
		return nil, "", fmt.Errorf("seal manifest: no content")
	}
	if _, ok := top["auth"]; ok {
		return nil, "", fmt.Errorf("seal manifest: content already has an auth member")
	}
	if _, ok := top["id"]; ok {
		return nil, "", fmt.Errorf("seal manifest: content already has an id member")
	}
	idx, err := buildIndex(top)
	if err != nil {
		return nil, "", fmt.Errorf("seal manifest: %w", err)
	}
	if idx.Check, err = idx.selfCheck(); err != nil {
		return nil, "", fmt.Errorf("seal manifest: %w", err)
	}
	ib, err := json.Marshal(idx)
	if err != nil {
		return nil, "", fmt.Errorf("seal manifest: %w", err)
	}
	b := make([]byte, 0, len(content)+len(`,"auth":`)+len(ib)+idTailLen)
	b = append(b, content[:len(content)-1]...)
	b = append(b, `,"auth":`...)
	b = append(b, ib...)
	b = append(b, idTail...)
	pos := len(b)
	b = append(b, zeroID...)
	b = append(b, "\"}\n"...)
	sum := blake3.Sum256(b)
	hex.Encode(b[pos:pos+64], sum[:])
	return b, hex.EncodeToString(sum[:]), nil
}

// sealedID checks a sealed manifest's trailing id against its bytes. It returns the id the file
// carries; err is a *ManifestMismatchError when they differ, ErrCorrupt when there is no id.
func sealedID(b []byte) (string, error) {
	n := len(b)
	if n < idTailLen || string(b[n-idTailLen:n-idTailLen+len(idTail)]) != idTail || string(b[n-3:]) != "\"}\n" {
		return "", fmt.Errorf("%w: manifest: a format 1.1 manifest ends with its id (`,\"id\":\"…\"}` and a newline)", ErrCorrupt)
	}
	pos := n - 3 - 64
	claimed := string(b[pos : pos+64])
	if !isID(claimed) {
		return "", fmt.Errorf("%w: manifest: id %.80q is not 64 lower-case hex digits", ErrCorrupt, claimed)
	}
	h := blake3.New()
	h.Write(b[:pos])
	h.Write(zeroID)
	h.Write(b[pos+64:])
	var sum [32]byte
	h.Sum(sum[:0])
	if hex.EncodeToString(sum[:]) != claimed {
		return claimed, &ManifestMismatchError{ID: claimed, Changes: locateChanges(b)}
	}
	return claimed, nil
}

// splitObject decodes one JSON object into its members' raw values.
func splitObject(raw []byte) (map[string]json.RawMessage, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, err
	}
	if m == nil {
		return nil, fmt.Errorf("not a JSON object")
	}
	return m, nil
}

// buildIndex computes the authentication index of a manifest's content members (top holds
// neither auth nor id).
func buildIndex(top map[string]json.RawMessage) (*authIndex, error) {
	idx := &authIndex{Alg: HashAlgorithm, Top: checks(top), Files: []string{}}
	if raw, ok := top["meta"]; ok {
		meta, err := splitObject(raw)
		if err != nil {
			return nil, fmt.Errorf("meta: %w", err)
		}
		idx.Meta = checks(meta)
		if raw, ok := meta["extra"]; ok && string(raw) != "null" {
			extra, err := splitObject(raw)
			if err != nil {
				return nil, fmt.Errorf("meta.extra: %w", err)
			}
			idx.Extra = checks(extra)
		}
	}
	err := eachFile(top["files"], func(i int, e fileEntry) error {
		idx.Files = append(idx.Files, e.index)
		return nil
	})
	return idx, err
}

// selfCheck is the check of the index's encoding with Check empty.
func (idx *authIndex) selfCheck() (string, error) {
	c := *idx
	c.Check = ""
	b, err := json.Marshal(&c)
	if err != nil {
		return "", err
	}
	return check(b, memberCheck), nil
}

func checks(members map[string]json.RawMessage) map[string]string {
	out := make(map[string]string, len(members))
	for k, v := range members {
		out[k] = check(v, memberCheck)
	}
	return out
}

// fileEntry is one file entry of a manifest as the index sees it.
type fileEntry struct {
	index  string
	path   string
	chunks []json.RawMessage
}

// eachFile calls fn for every entry of a manifest's files member, in order, one at a time (so
// memory stays that of the largest entry).
func eachFile(files json.RawMessage, fn func(i int, e fileEntry) error) error {
	if len(files) == 0 || string(files) == "null" {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(files))
	if t, err := dec.Token(); err != nil || t != json.Delim('[') {
		return fmt.Errorf("files: not an array")
	}
	for i := 0; dec.More(); i++ {
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return fmt.Errorf("files[%d]: %w", i, err)
		}
		e, err := fileIndex(raw)
		if err != nil {
			return fmt.Errorf("files[%d]: %w", i, err)
		}
		if err := fn(i, e); err != nil {
			return err
		}
	}
	return nil
}

func fileIndex(raw json.RawMessage) (fileEntry, error) {
	f, err := splitObject(raw)
	if err != nil {
		return fileEntry{}, err
	}
	var e fileEntry
	_ = json.Unmarshal(f["path"], &e.path)
	var b strings.Builder
	for _, k := range fileMembers {
		if v, ok := f[k]; ok {
			b.WriteString(check(v, entryCheck))
		} else {
			b.WriteString(absent)
		}
	}
	var others []string
	for k := range f {
		if !slices.Contains(fileMembers[:], k) {
			others = append(others, k)
		}
	}
	if len(others) == 0 {
		b.WriteString(absent)
	} else {
		sort.Strings(others)
		h := blake3.New()
		for _, k := range others {
			kb, _ := json.Marshal(k)
			h.Write(kb)
			h.Write([]byte{':'})
			h.Write(f[k])
			h.Write([]byte{','})
		}
		var sum [32]byte
		b.WriteString(hex.EncodeToString(h.Sum(sum[:0])[:entryCheck]))
	}
	if cr, ok := f["chunks"]; ok && string(cr) != "null" {
		if err := json.Unmarshal(cr, &e.chunks); err != nil {
			return fileEntry{}, fmt.Errorf("chunks: %w", err)
		}
		b.WriteByte('|')
		for _, c := range e.chunks {
			b.WriteString(check(c, entryCheck))
		}
	}
	e.index = b.String()
	return e, nil
}

// locateChanges compares a sealed manifest's members with its authentication index and names
// what differs. It runs only once the id did not match, so it favours clear names over speed.
func locateChanges(b []byte) []string {
	top, err := splitObject(b)
	if err != nil {
		return []string{fmt.Sprintf("the manifest is no longer valid JSON (%v)", err)}
	}
	var stored authIndex
	ar, ok := top["auth"]
	if !ok {
		return []string{"the auth member (the authentication index) was removed"}
	}
	if err := json.Unmarshal(ar, &stored); err != nil || stored.Top == nil {
		return []string{"the auth member (the authentication index) is damaged; which field changed is unknown"}
	}
	if c, err := stored.selfCheck(); err != nil || c != stored.Check {
		return []string{"the auth member (the authentication index) was edited; which field changed is unknown"}
	}
	delete(top, "auth")
	delete(top, "id")
	var out []string
	curTop := checks(top)
	for _, k := range unionKeys(stored.Top, curTop) {
		if stored.Top[k] == curTop[k] {
			continue
		}
		var sub []string
		switch {
		case k == "meta" && stored.Top[k] != "" && curTop[k] != "":
			sub = diffMeta(&stored, top["meta"])
		case k == "files" && stored.Top[k] != "" && curTop[k] != "":
			sub = diffFiles(stored.Files, top["files"])
		}
		if len(sub) == 0 {
			sub = []string{memberChange(k, stored.Top, curTop)}
		}
		out = append(out, sub...)
	}
	if len(out) == 0 {
		// Every field matches its check: the id or the bytes between fields were edited.
		out = append(out, "the id, or bytes outside every field (formatting), were edited")
	}
	if len(out) > maxChangesListed {
		out = append(out[:maxChangesListed], fmt.Sprintf("and %d more changes", len(out)-maxChangesListed))
	}
	return out
}

// maxChangesListed bounds the changes an authentication failure names; the rest are counted.
const maxChangesListed = 32

// memberChange names a change of member k between two check maps.
func memberChange(k string, stored, cur map[string]string) string {
	_, was := stored[k]
	_, is := cur[k]
	return changeLabel(k, was, is)
}

func changeLabel(label string, was, is bool) string {
	switch {
	case !was:
		return label + " added"
	case !is:
		return label + " removed"
	}
	return label
}

func unionKeys(a, b map[string]string) []string {
	var ks []string
	for k := range a {
		ks = append(ks, k)
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			ks = append(ks, k)
		}
	}
	sort.Slice(ks, func(i, j int) bool {
		return topOrder(ks[i]) < topOrder(ks[j]) || topOrder(ks[i]) == topOrder(ks[j]) && ks[i] < ks[j]
	})
	return ks
}

// topOrder puts the manifest's fields in their encoding order; other keys sort after them.
func topOrder(k string) int {
	for i, f := range []string{"format_version", "name", "parent", "created", "meta", "hash", "chunk_size", "files"} {
		if k == f {
			return i
		}
	}
	return 100
}

func diffMeta(stored *authIndex, raw json.RawMessage) []string {
	meta, err := splitObject(raw)
	if err != nil {
		return nil
	}
	cur := checks(meta)
	var out []string
	for _, k := range unionKeys(stored.Meta, cur) {
		if stored.Meta[k] == cur[k] {
			continue
		}
		if k == "extra" && stored.Meta[k] != "" && cur[k] != "" {
			if extra, err := splitObject(meta["extra"]); err == nil {
				curExtra := checks(extra)
				n := len(out)
				for _, e := range unionKeys(stored.Extra, curExtra) {
					if stored.Extra[e] != curExtra[e] {
						_, was := stored.Extra[e]
						_, is := curExtra[e]
						out = append(out, changeLabel(fmt.Sprintf("meta.extra[%q]", e), was, is))
					}
				}
				if len(out) > n {
					continue
				}
			}
		}
		out = append(out, "meta."+memberChange(k, stored.Meta, cur))
	}
	return out
}

// diffFiles names the changed file entries. Entries are matched by position when their number
// is unchanged, else by the check of their path.
func diffFiles(stored []string, files json.RawMessage) []string {
	var out []string
	var cur []fileEntry // only when the number of entries changed
	n := 0
	err := eachFile(files, func(i int, e fileEntry) error {
		n++
		if i < len(stored) {
			out = append(out, diffEntry(i, e, stored[i])...)
		}
		e.chunks = nil
		cur = append(cur, e)
		return nil
	})
	if err != nil {
		return append(out, fmt.Sprintf("files: %v", err))
	}
	if n == len(stored) {
		return out
	}
	// Entries were added or removed: match them by path instead.
	out = []string{fmt.Sprintf("files: %d entries, the manifest was written with %d", n, len(stored))}
	byPath := map[string][]int{}
	for j, s := range stored {
		if len(s) >= entryWidth {
			byPath[s[:entryWidth]] = append(byPath[s[:entryWidth]], j)
		}
	}
	for i, e := range cur {
		key := e.index[:entryWidth]
		js := byPath[key]
		if len(js) == 0 {
			out = append(out, fmt.Sprintf("files[%q] added (or its path changed)", e.path))
			continue
		}
		byPath[key] = js[1:]
		out = append(out, diffEntry(i, e, stored[js[0]])...)
	}
	removed := 0
	for _, js := range byPath {
		removed += len(js)
	}
	if removed > 0 {
		out = append(out, fmt.Sprintf("%d file entries removed (or their paths changed)", removed))
	}
	return out
}

// diffEntry names the changed members of file entry i, down to the chunk, against its index.
func diffEntry(i int, e fileEntry, stored string) []string {
	if e.index == stored {
		return nil
	}
	name := fmt.Sprintf("files[%q]", e.path)
	sHead, sChunks, _ := strings.Cut(stored, "|")
	cHead, cChunks, _ := strings.Cut(e.index, "|")
	if len(sHead) != len(cHead) {
		return []string{name + ": its index entry is damaged"}
	}
	var out []string
	for k := range otherMembers + 1 {
		sc, cc := sHead[k*entryWidth:(k+1)*entryWidth], cHead[k*entryWidth:(k+1)*entryWidth]
		if sc == cc {
			continue
		}
		if k == otherMembers {
			out = append(out, name+": a field this ptxmig does not know")
			continue
		}
		member := fileMembers[k]
		if member == "path" {
			out = append(out, fmt.Sprintf("files[%d].path (now %q)", i, e.path))
			continue
		}
		if member == "chunks" && sc != absent && cc != absent {
			if cs := diffChunks(name, sChunks, cChunks, e.chunks); len(cs) > 0 {
				out = append(out, cs...)
				continue
			}
		}
		out = append(out, name+"."+changeLabel(member, sc != absent, cc != absent))
	}
	if len(out) == 0 && sChunks != cChunks {
		out = append(out, name+".chunks")
	}
	return out
}

func diffChunks(name, stored, cur string, chunks []json.RawMessage) []string {
	if len(stored)%entryWidth != 0 || len(cur)%entryWidth != 0 {
		return nil
	}
	if len(stored) != len(cur) {
		return []string{fmt.Sprintf("%s.chunks: %d entries, the manifest was written with %d", name, len(cur)/entryWidth, len(stored)/entryWidth)}
	}
	var out []string
	for j := 0; j < len(cur)/entryWidth; j++ {
		if stored[j*entryWidth:(j+1)*entryWidth] == cur[j*entryWidth:(j+1)*entryWidth] {
			continue
		}
		label := fmt.Sprintf("%s.chunks[%d]", name, j)
		var c struct {
			Offset int64 `json:"offset"`
		}
		if j < len(chunks) && json.Unmarshal(chunks[j], &c) == nil {
			label += fmt.Sprintf(" (offset %d)", c.Offset)
		}
		out = append(out, label)
	}
	return out
}

// errNotAuthenticated is what Manifest.Authenticated's callers log for a format 1.0 image.
var errNotAuthenticated = errors.New("manifest format 1.0 predates manifest authentication: its chunks are checked, its manifest cannot be (export it and import it with --name to seal a copy)")
