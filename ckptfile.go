package zero

import (
	"cmp"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"io"
	"slices"
)

// A rank's checkpoint file: its sections (one tensor each, in the shard
// layout of the plan that wrote it, and the caller's bytes), then a JSON
// footer that says where each section lies, with a CRC32C per chunk of it,
// and which parameter ranges the shard holds; then a fixed trailer that
// points at the footer. Written in one pass, front to back; read from any
// offset, each chunk checked against its CRC before its bytes are used.
// Parameter ranges, never flat offsets, say what the bytes are, so another
// plan (another world size, stage or bucket size) can find its part.

const (
	ckptChunk      = 8 << 20 // bytes per CRC, and per read or write
	ckptTrailerLen = 24
	ckptRankMagic  = "zero-rank"
	ckptTrailerTag = "ZCK1"
	// ckptVersion is the format version, of the files and the manifest. A
	// reader refuses a newer one and reads every older one. Version 2 added
	// the save's identity to the manifest and every rank file's footer, and
	// saves the loss scale of the step's mean loss (scalerState says what a
	// version-1 scale means).
	ckptVersion = 2
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ckptSegment says that elements [ParamOffset, ParamOffset+Count) of
// parameter Param sit at [ShardOffset, ShardOffset+Count) of the file's
// shard sections.
type ckptSegment struct {
	Param, ParamOffset, Count, ShardOffset int64
}

// MarshalJSON writes a segment as four numbers: a model has many.
func (s ckptSegment) MarshalJSON() ([]byte, error) {
	return json.Marshal([4]int64{s.Param, s.ParamOffset, s.Count, s.ShardOffset})
}

func (s *ckptSegment) UnmarshalJSON(b []byte) error {
	var v [4]int64
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*s = ckptSegment{v[0], v[1], v[2], v[3]}
	return nil
}

// ckptSection is where one section lies in a rank file.
type ckptSection struct {
	Name   string   `json:"name"`
	DType  string   `json:"dtype"` // "" for the caller's bytes
	Offset int64    `json:"offset"`
	Bytes  int64    `json:"bytes"`
	CRC    []uint32 `json:"crc32c"` // one per ckptChunk of the section
}

// ckptFooter is a rank file's table of contents.
type ckptFooter struct {
	Magic      string        `json:"magic"`
	Version    int           `json:"version"`
	Save       string        `json:"save,omitempty"` // the save's identity, as the manifest's (version 2)
	Rank       int           `json:"rank"`
	World      int           `json:"world"`
	ShardElems int64         `json:"shard_elems"`
	Segments   []ckptSegment `json:"segments"`
	Sections   []ckptSection `json:"sections"`
}

func (f *ckptFooter) section(name string) (*ckptSection, bool) {
	for i := range f.Sections {
		if f.Sections[i].Name == name {
			return &f.Sections[i], true
		}
	}
	return nil, false
}

// rankWriter writes a rank file front to back and keeps the CRC of all of
// it, for the manifest.
type rankWriter struct {
	f      ckptFile
	name   string
	off    int64
	crc    uint32 // of the whole file so far
	footer ckptFooter
	sec    *ckptSection // the section being written
	stop   func() error // non-nil error: stop before the next chunk (an Abort)
	chunk  uint32       // CRC of the section's current chunk
	inChk  int64        // bytes in the current chunk
}

func newRankWriter(f ckptFile, name string, footer ckptFooter) *rankWriter {
	footer.Magic, footer.Version = ckptRankMagic, ckptVersion
	return &rankWriter{f: f, name: name, footer: footer}
}

// createRankFile writes a rank file at name through a temporary name,
// renamed once whole: the sections body writes, then the client bytes,
// then the footer; stop (nil: never) ends it before its next chunk. It
// returns the file's size and CRC32C.
func createRankFile(fsys ckptFS, name string, footer ckptFooter, stop func() error, client []byte, body func(*rankWriter) error) (int64, uint32, error) {
	tmp := name + ".tmp"
	f, err := fsys.Create(tmp)
	if err != nil {
		return 0, 0, fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	w := newRankWriter(f, name, footer)
	w.stop = stop
	err = body(w)
	if err == nil {
		w.begin("client", 0)
		err = w.add(client)
		w.end()
	}
	var size int64
	var crc uint32
	if err == nil {
		size, crc, err = w.finish()
	}
	if cerr := f.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("%w: %w", ErrCheckpoint, cerr)
	}
	if err == nil {
		if err = fsys.Rename(tmp, name); err != nil {
			err = fmt.Errorf("%w: %w", ErrCheckpoint, err)
		}
	}
	return size, crc, err
}

func (w *rankWriter) write(p []byte) error {
	return w.writeWhile(p, nil)
}

// writeWhile writes p, summing its CRC and running also (a reader of p
// only) on this goroutine while another one writes: the checksums cost
// no time beside the write.
func (w *rankWriter) writeWhile(p []byte, also func()) error {
	written := make(chan error, 1)
	go func() {
		_, err := w.f.Write(p)
		written <- err
	}()
	w.crc = crc32.Update(w.crc, castagnoli, p)
	if also != nil {
		also()
	}
	if err := <-written; err != nil {
		return fmt.Errorf("%w: writing %s: %w", ErrCheckpoint, w.name, err)
	}
	w.off += int64(len(p))
	return nil
}

// begin starts a section.
func (w *rankWriter) begin(name string, dt DType) {
	d := ""
	if dt != 0 {
		d = dt.String()
	}
	w.footer.Sections = append(w.footer.Sections, ckptSection{Name: name, DType: d, Offset: w.off})
	w.sec = &w.footer.Sections[len(w.footer.Sections)-1]
	w.chunk, w.inChk = 0, 0
}

// add appends p to the current section, a chunk's CRC at a time.
func (w *rankWriter) add(p []byte) error {
	chunks := func() {
		for q := p; len(q) > 0; {
			n := min(int64(len(q)), ckptChunk-w.inChk)
			w.chunk = crc32.Update(w.chunk, castagnoli, q[:n])
			w.inChk += n
			q = q[n:]
			if w.inChk == ckptChunk {
				w.sec.CRC = append(w.sec.CRC, w.chunk)
				w.chunk, w.inChk = 0, 0
			}
		}
	}
	if err := w.writeWhile(p, chunks); err != nil {
		return err
	}
	w.sec.Bytes += int64(len(p))
	return nil
}

// end closes the current section.
func (w *rankWriter) end() {
	if w.inChk > 0 {
		w.sec.CRC = append(w.sec.CRC, w.chunk)
	}
	w.sec = nil
}

// finish writes the footer and the trailer and fsyncs the file; it
// returns the file's size and CRC.
func (w *rankWriter) finish() (int64, uint32, error) {
	foot, err := json.Marshal(&w.footer)
	if err != nil {
		return 0, 0, err
	}
	at := w.off
	if err := w.write(foot); err != nil {
		return 0, 0, err
	}
	var tr [ckptTrailerLen]byte
	binary.LittleEndian.PutUint64(tr[0:], uint64(at))
	binary.LittleEndian.PutUint64(tr[8:], uint64(len(foot)))
	binary.LittleEndian.PutUint32(tr[16:], crc32.Checksum(foot, castagnoli))
	copy(tr[20:], ckptTrailerTag)
	if err := w.write(tr[:]); err != nil {
		return 0, 0, err
	}
	if err := w.f.Sync(); err != nil {
		return 0, 0, fmt.Errorf("%w: fsync of %s: %w", ErrCheckpoint, w.name, err)
	}
	return w.off, w.crc, nil
}

// rankReader reads a rank file's sections, checking each chunk.
type rankReader struct {
	f      ckptFile
	name   string
	footer ckptFooter
	buf    []byte       // one chunk
	stop   func() error // non-nil error: stop before the next read (an Abort)
	// verified: the whole file matched the manifest's CRC32C, so reads
	// go straight into the caller's memory, without the chunks' checks.
	verified bool
}

// openRankFile opens name and reads its footer; want is the size the
// manifest recorded (a truncated or grown file is refused before any read).
func openRankFile(fsys ckptFS, name string, want int64, stop func() error) (*rankReader, error) {
	f, err := fsys.Open(name)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w; the checkpoint is missing a rank's file: load another checkpoint", ErrCheckpoint, name, err)
	}
	r := &rankReader{f: f, name: name, stop: stop}
	if err := r.readFooter(want); err != nil {
		f.Close()
		return nil, err
	}
	return r, nil
}

// readAt reads p at off, unless the load was stopped meanwhile.
func (r *rankReader) readAt(p []byte, off int64) (int, error) {
	if r.stop != nil {
		if err := r.stop(); err != nil {
			return 0, err
		}
	}
	return r.f.ReadAt(p, off)
}

func (r *rankReader) corrupt(format string, args ...any) error {
	return fmt.Errorf("%w: %s: %s; the file is damaged: load another checkpoint", ErrCheckpoint, r.name, fmt.Sprintf(format, args...))
}

func (r *rankReader) readFooter(want int64) error {
	size, err := r.f.Size()
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrCheckpoint, r.name, err)
	}
	if size != want {
		return r.corrupt("%d bytes, the manifest says %d", size, want)
	}
	if size < ckptTrailerLen {
		return r.corrupt("too short for a checkpoint file")
	}
	var tr [ckptTrailerLen]byte
	if _, err := r.readAt(tr[:], size-ckptTrailerLen); err != nil {
		return r.corrupt("reading its trailer: %v", err)
	}
	at, n := binary.LittleEndian.Uint64(tr[0:]), binary.LittleEndian.Uint64(tr[8:])
	body := uint64(size - ckptTrailerLen)
	if string(tr[20:]) != ckptTrailerTag || at > body || n != body-at {
		return r.corrupt("no valid trailer")
	}
	foot := make([]byte, n) // at most the file's size
	if _, err := r.readAt(foot, int64(at)); err != nil {
		return r.corrupt("reading its footer: %v", err)
	}
	if crc32.Checksum(foot, castagnoli) != binary.LittleEndian.Uint32(tr[16:]) {
		return r.corrupt("its footer fails its checksum")
	}
	if err := json.Unmarshal(foot, &r.footer); err != nil {
		return r.corrupt("its footer: %v", err)
	}
	if r.footer.Magic != ckptRankMagic {
		return r.corrupt("not a zero rank file")
	}
	if r.footer.Version > ckptVersion {
		return fmt.Errorf("%w: %s: format version %d, newer than this library's %d; load it with a newer zero", ErrCheckpoint, r.name, r.footer.Version, ckptVersion)
	}
	// every section inside the file's sections, none over another (the
	// sums cannot overflow: each term is checked against the end first)
	end := int64(at)
	secs := slices.Clone(r.footer.Sections)
	slices.SortFunc(secs, func(a, b ckptSection) int { return cmp.Compare(a.Offset, b.Offset) })
	next := int64(0)
	for _, s := range secs {
		if s.Offset < next || s.Offset > end || s.Bytes < 0 || s.Bytes > end-s.Offset || int64(len(s.CRC)) != (s.Bytes+ckptChunk-1)/ckptChunk {
			return r.corrupt("section %q (%d bytes at %d, %d checksums) lies outside the file's %d bytes of sections or over another", s.Name, s.Bytes, s.Offset, len(s.CRC), end)
		}
		next = s.Offset + s.Bytes
	}
	return nil
}

// chunk reads chunk c of section s and checks it; the bytes are valid
// until the next call.
func (r *rankReader) chunk(s *ckptSection, c int64) ([]byte, error) {
	lo := c * ckptChunk
	n := min(ckptChunk, s.Bytes-lo) // a chunk, or the section's last bytes
	if int64(len(r.buf)) < n {
		r.buf = make([]byte, n)
	}
	b := r.buf[:n]
	if _, err := r.readAt(b, s.Offset+lo); err != nil && err != io.EOF {
		return nil, r.corrupt("reading section %q: %v", s.Name, err)
	}
	if crc32.Checksum(b, castagnoli) != s.CRC[c] {
		return nil, r.corrupt("section %q fails its checksum in bytes %d-%d", s.Name, lo, lo+int64(len(b)))
	}
	return b, nil
}

// read fills p with bytes [off, off+len(p)) of section s, reading and
// checking every chunk they touch.
func (r *rankReader) read(s *ckptSection, off int64, p []byte) error {
	if off < 0 || off > s.Bytes || int64(len(p)) > s.Bytes-off {
		return r.corrupt("section %q has %d bytes, %d wanted at %d", s.Name, s.Bytes, len(p), off)
	}
	if r.verified {
		if _, err := r.readAt(p, s.Offset+off); err != nil && err != io.EOF {
			return r.corrupt("reading section %q: %v", s.Name, err)
		}
		return nil
	}
	for len(p) > 0 {
		c := off / ckptChunk
		b, err := r.chunk(s, c)
		if err != nil {
			return err
		}
		k := copy(p, b[off-c*ckptChunk:])
		p, off = p[k:], off+int64(k)
	}
	return nil
}

// verify reads every section whole and checks every chunk.
func (r *rankReader) verify() error {
	for i := range r.footer.Sections {
		s := &r.footer.Sections[i]
		for c := range int64(len(s.CRC)) {
			if _, err := r.chunk(s, c); err != nil {
				return err
			}
		}
	}
	return nil
}

func (r *rankReader) close() error { return r.f.Close() }

// stateTensor is a tensor of state in the plan's shard layout, and where
// it is read and written (the home's side, or the device for the
// model-dtype shard).
type stateTensor struct {
	name string
	t    Tensor
	dev  Device
	s    Stream
}
