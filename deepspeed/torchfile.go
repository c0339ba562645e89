package deepspeed

import (
	"archive/zip"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/nlpodyssey/gopickle/pickle"
	"github.com/nlpodyssey/gopickle/types"
)

// A PyTorch file (torch.save since 1.6) is a zip archive: PREFIX/data.pkl,
// the pickled object, whose tensors refer by key to their storages,
// PREFIX/data/KEY, raw little-endian bytes; PREFIX/byteorder says "little".
// The zip is walked here, not by gopickle's pytorch.Load, which allocates
// each storage from the pickle's declared size before reading it and
// builds any class the pickle names. Here the pickle's opcodes are checked
// first (prescan.go), gopickle's unpickler builds only the allow-listed
// classes (classes.go), and each storage's declared size must be exactly
// its zip entry's before a byte is allocated for it.

// torchFile is one PyTorch file, unpickled.
type torchFile struct {
	name   string
	root   any
	budget int64 // bytes of tensors still allowed to be materialized from it
}

// maxMarkDepth bounds the unpickler's nested MARKs: each holds a stack.
const maxMarkDepth = 1024

// openTorchFile reads and unpickles the file at path.
func openTorchFile(path string) (*torchFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, &Error{Kind: ErrInconsistent, File: path, Msg: err.Error()}
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, &Error{Kind: ErrInconsistent, File: path, Msg: err.Error()}
	}
	if !st.Mode().IsRegular() {
		return nil, errorf(ErrInconsistent, path, "not a regular file")
	}
	t, err := decodeTorch(f, st.Size())
	if err != nil {
		return nil, inFile(err, path)
	}
	t.name = path
	return t, nil
}

// decodeTorch unpickles a PyTorch file of size bytes read from r.
func decodeTorch(r io.ReaderAt, size int64) (t *torchFile, err error) {
	var head [4]byte
	if _, err := r.ReadAt(head[:], 0); err != nil {
		return nil, errorf(ErrFormat, "", "shorter than a zip header (%d bytes)", size)
	}
	if string(head[:]) != "PK\x03\x04" {
		if head[0] == 0x80 { // a pickle's PROTO: torch.save's format before 1.6
			return nil, errorf(ErrLegacy, "", "a bare pickle (PyTorch's format before 1.6), which the reader refuses before unpickling; load it in Python and save it again with torch.save (the zip format)")
		}
		return nil, errorf(ErrFormat, "", "not a zip archive (PyTorch's file format)")
	}
	zr, err := zip.NewReader(r, size)
	if err != nil {
		return nil, errorf(ErrFormat, "", "zip: %v", err)
	}
	ents := make(map[string]*zip.File, len(zr.File))
	prefix := ""
	for _, e := range zr.File {
		if _, dup := ents[e.Name]; dup {
			return nil, errorf(ErrFormat, "", "zip: entry %q twice", e.Name)
		}
		ents[e.Name] = e
		if dir, ok := strings.CutSuffix(e.Name, "/data.pkl"); ok && !strings.Contains(dir, "/") {
			if prefix != "" {
				return nil, errorf(ErrFormat, "", "zip: two pickles (%s/data.pkl and %s)", prefix, e.Name)
			}
			prefix = dir
		}
	}
	if prefix == "" {
		return nil, errorf(ErrFormat, "", "zip: no PREFIX/data.pkl (not a file torch.save wrote)")
	}
	if e, ok := ents[prefix+"/byteorder"]; ok {
		b, err := readEntry(e, size, 16)
		if err != nil {
			return nil, err
		}
		if string(b) != "little" {
			return nil, errorf(ErrUnsupported, "", "byteorder %q: only little-endian files are read", b)
		}
	}
	pkl, err := readEntry(ents[prefix+"/data.pkl"], size, size)
	if err != nil {
		return nil, err
	}
	if err := prescan(pkl); err != nil {
		return nil, err
	}
	st := &storages{ents: ents, prefix: prefix + "/data/", size: size, loaded: map[string]*storage{}}
	u := pickle.NewUnpickler(bytes.NewReader(pkl))
	u.FindClass = findClass
	u.PersistentLoad = st.load
	defer func() {
		if p := recover(); p != nil {
			t, err = nil, errorf(ErrFormat, "", "pickle: the unpickler failed on malformed input (%v)", p)
		}
	}()
	root, err := u.Load()
	if err != nil {
		var e *Error
		if errors.As(err, &e) {
			return nil, err
		}
		return nil, errorf(ErrFormat, "", "pickle: %v", err)
	}
	return &torchFile{root: root, budget: 2 * size}, nil
}

// readEntry reads a stored (uncompressed) zip entry of at most limit
// bytes, checking its CRC. torch.save stores every entry uncompressed, so
// a compressed one is refused: it could inflate far beyond the file.
func readEntry(e *zip.File, fileSize, limit int64) ([]byte, error) {
	if e.Method != zip.Store {
		return nil, errorf(ErrFormat, "", "zip: entry %s is compressed (method %d); torch.save stores entries uncompressed", e.Name, e.Method)
	}
	off, err := e.DataOffset()
	if err != nil {
		return nil, errorf(ErrFormat, "", "zip: entry %s: %v", e.Name, err)
	}
	n := e.UncompressedSize64
	if n != e.CompressedSize64 || n > uint64(limit) || off < 0 || n > uint64(fileSize-off) {
		return nil, errorf(ErrFormat, "", "zip: entry %s declares %d bytes at offset %d of a %d-byte file", e.Name, n, off, fileSize)
	}
	rc, err := e.Open()
	if err != nil {
		return nil, errorf(ErrFormat, "", "zip: entry %s: %v", e.Name, err)
	}
	defer rc.Close()
	b := make([]byte, n)
	if _, err := io.ReadFull(rc, b); err != nil {
		return nil, errorf(ErrFormat, "", "zip: entry %s: %v", e.Name, err)
	}
	// reading to EOF checks the CRC
	if _, err := rc.Read(make([]byte, 1)); err != io.EOF {
		return nil, errorf(ErrFormat, "", "zip: entry %s: %v", e.Name, err)
	}
	return b, nil
}

// storage is one PREFIX/data/KEY entry.
type storage struct {
	dtype DType
	data  []byte
}

// storages loads the storages a pickle's persistent ids name, each once.
type storages struct {
	ents   map[string]*zip.File
	prefix string
	size   int64
	loaded map[string]*storage
}

// load is the unpickler's persistent_load: ('storage', StorageClass,
// key, location, numel). The declared numel must be exactly the entry's
// size before the entry is read.
func (s *storages) load(pid any) (any, error) {
	t, ok := pid.(*types.Tuple)
	if !ok || t.Len() != 5 {
		return nil, errorf(ErrFormat, "", "pickle: a persistent id that is not ('storage', type, key, location, numel): %s", describe(pid))
	}
	kind, _ := t.Get(0).(string)
	cls, okc := t.Get(1).(storageClass)
	key, okk := t.Get(2).(string)
	n, okn := t.Get(4).(int)
	if kind != "storage" || !okc || !okk || !okn || n < 0 {
		return nil, errorf(ErrFormat, "", "pickle: a persistent id that is not ('storage', type, key, location, numel): %s", describe(pid))
	}
	if st, ok := s.loaded[key]; ok {
		if st.dtype != cls.dtype || len(st.data) != n*cls.dtype.Size() {
			return nil, errorf(ErrFormat, "", "storage %s declared as %d %v and as %d %v", key, len(st.data)/st.dtype.Size(), st.dtype, n, cls.dtype)
		}
		return st, nil
	}
	e, ok := s.ents[s.prefix+key]
	if !ok {
		return nil, errorf(ErrFormat, "", "storage %s: no entry %s%s in the zip", key, s.prefix, key)
	}
	es := cls.dtype.Size()
	if uint64(n) > e.UncompressedSize64/uint64(es) || uint64(n)*uint64(es) != e.UncompressedSize64 {
		return nil, errorf(ErrFormat, "", "storage %s declares %d %v elements (%d bytes) but its entry holds %d bytes", key, n, cls.dtype, uint64(n)*uint64(es), e.UncompressedSize64)
	}
	b, err := readEntry(e, s.size, s.size)
	if err != nil {
		return nil, err
	}
	st := &storage{dtype: cls.dtype, data: b}
	s.loaded[key] = st
	return st, nil
}

// describe names a pickled value's type for a message, without printing
// the value (which may be large or self-referencing).
func describe(v any) string {
	switch v := v.(type) {
	case nil:
		return "None"
	case string:
		if len(v) > 64 {
			v = v[:64] + "…"
		}
		return fmt.Sprintf("%q", v)
	case int, float64, bool:
		return fmt.Sprint(v)
	case *types.Tuple:
		return fmt.Sprintf("a tuple of %d", v.Len())
	case *types.List:
		return fmt.Sprintf("a list of %d", v.Len())
	case *types.Dict:
		return fmt.Sprintf("a dict of %d", v.Len())
	case *types.OrderedDict:
		return fmt.Sprintf("an OrderedDict of %d", v.Len())
	}
	return fmt.Sprintf("%T", v)
}
