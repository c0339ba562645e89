package deepspeed

import (
	"archive/zip"
	"bytes"
	"encoding/binary"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// pk builds protocol-2 pickles by hand, for the files a test needs.
type pk struct{ bytes.Buffer }

func (p *pk) op(b ...byte) *pk { p.Write(b); return p }
func (p *pk) str(s string) *pk {
	p.WriteByte('X')
	binary.Write(&p.Buffer, binary.LittleEndian, uint32(len(s)))
	p.WriteString(s)
	return p
}
func (p *pk) int(n int) *pk {
	if int(int32(n)) != n {
		p.op(0x8a, 8) // LONG1
		binary.Write(&p.Buffer, binary.LittleEndian, int64(n))
		return p
	}
	p.WriteByte('J')
	binary.Write(&p.Buffer, binary.LittleEndian, int32(n))
	return p
}
func (p *pk) global(mod, name string) *pk { p.WriteString("c" + mod + "\n" + name + "\n"); return p }

// tensorPickle is {"t": tensor} whose tensor is a view (offset, size,
// stride) of storage "0" declared with numel elements of cls.
func tensorPickle(cls string, numel, offset int, size, stride []int) []byte {
	p := &pk{}
	p.op(0x80, 2, '}', '(').str("t")
	p.global("torch._utils", "_rebuild_tensor_v2").op('(')
	p.op('(').str("storage").global("torch", cls).str("0").str("cpu").int(numel).op('t', 'Q')
	p.int(offset)
	p.op('(')
	for _, d := range size {
		p.int(d)
	}
	p.op('t', '(')
	for _, d := range stride {
		p.int(d)
	}
	p.op('t', 0x89)
	p.global("collections", "OrderedDict").op(')', 'R')
	p.op('t', 'R', 'u', '.')
	return p.Bytes()
}

// torchZip lays out a file as torch.save does: archive/data.pkl,
// archive/byteorder, archive/data/KEY, each stored.
func torchZip(t testing.TB, pkl []byte, storages map[string][]byte, method uint16) []byte {
	return torchZipOrder(t, pkl, storages, method, "little")
}

func torchZipOrder(t testing.TB, pkl []byte, storages map[string][]byte, method uint16, order string) []byte {
	var b bytes.Buffer
	w := zip.NewWriter(&b)
	put := func(name string, data []byte, m uint16) {
		f, err := w.CreateHeader(&zip.FileHeader{Name: "archive/" + name, Method: m})
		if err != nil {
			t.Fatal(err)
		}
		f.Write(data)
	}
	if pkl != nil {
		put("data.pkl", pkl, zip.Store)
	}
	put("byteorder", []byte(order), zip.Store)
	for k, v := range storages {
		put("data/"+k, v, method)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func decodeBytes(b []byte) (*torchFile, error) { return decodeTorch(bytes.NewReader(b), int64(len(b))) }

// TestTorchFileGolden: every PyTorch file DeepSpeed wrote for the golden
// runs (ZeRO-1/2/3 checkpoints and the universal layout) passes the
// prescan and the allow-list.
func TestTorchFileGolden(t *testing.T) {
	n := 0
	filepath.WalkDir(golden, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !strings.HasSuffix(path, ".pt") {
			return err
		}
		if _, err := openTorchFile(path); err != nil {
			t.Errorf("%v", err)
		}
		n++
		return nil
	})
	if n < 200 {
		t.Errorf("read %d files", n)
	}
}

// TestTorchFileTensor: a hand-made file's tensor is read with its view
// applied (a transposed view copies out row-major).
func TestTorchFileTensor(t *testing.T) {
	data := float32Bytes([]float32{0, 1, 2, 3, 4, 5})
	f, err := decodeBytes(torchZip(t, tensorPickle("FloatStorage", 6, 0, []int{3, 2}, []int{1, 3}), map[string][]byte{"0": data}, zip.Store))
	if err != nil {
		t.Fatal(err)
	}
	v, _ := field(f.root, "t")
	got, _ := v.(*tensorView).materialize().Float32s()
	want := []float32{0, 3, 1, 4, 2, 5}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("transposed view read %v, want %v", got, want)
		}
	}
}

// TestTorchFileRefusals: each bad input gets its typed error, and no
// panic escapes.
func TestTorchFileRefusals(t *testing.T) {
	good := float32Bytes([]float32{1, 2, 3, 4})
	tp := func(numel, off int, size, stride []int) []byte {
		return torchZip(t, tensorPickle("FloatStorage", numel, off, size, stride), map[string][]byte{"0": good}, zip.Store)
	}
	withPickle := func(p []byte) []byte { return torchZip(t, p, nil, zip.Store) }
	golden, err := os.ReadFile(filepath.Join(golden, "z2-fp32", "ckpt", "global_step3", "mp_rank_00_model_states.pt"))
	if err != nil {
		t.Fatal(err)
	}
	hooks := tensorPickle("FloatStorage", 4, 0, []int{4}, []int{1})
	hooks = bytes.Replace(hooks, []byte("\nOrderedDict\n)R"), []byte("\nOrderedDict\n)R(K\x01K\x02u"), 1)
	bigEndian := torchZipOrder(t, tensorPickle("FloatStorage", 4, 0, []int{4}, []int{1}), map[string][]byte{"0": good}, zip.Store, "big")
	for _, c := range []struct {
		name string
		in   []byte
		kind error
		say  string
	}{
		{"legacy", []byte{0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, '.'}, ErrLegacy, "before 1.6"},
		{"not a zip", []byte("hello, world"), ErrFormat, "not a zip"},
		{"empty", nil, ErrFormat, "zip header"},
		{"truncated", golden[:len(golden)/2], ErrFormat, "zip"},
		{"no pickle", torchZip(t, nil, map[string][]byte{"0": good}, zip.Store), ErrFormat, "no PREFIX/data.pkl"},
		{"os.system", withPickle((&pk{}).op(0x80, 2).global("os", "system").str("true").op(0x85, 'R', '.').Bytes()), ErrUnsafe, "os.system"},
		{"builtins.eval", withPickle((&pk{}).op(0x80, 2).global("builtins", "eval").op('.').Bytes()), ErrUnsafe, "builtins.eval"},
		{"gopickle's own object", withPickle((&pk{}).op(0x80, 2).global("__builtin__", "object").op('.').Bytes()), ErrUnsafe, "__builtin__.object"},
		{"stack global", withPickle((&pk{}).op(0x80, 2).str("os").str("system").op(0x93, '.').Bytes()), ErrUnsafe, "opcode 0x93"},
		{"inst", withPickle([]byte("(ios\nsystem\n.")), ErrUnsafe, "opcode 0x69"},
		{"declared far beyond its entry", torchZip(t, tensorPickle("FloatStorage", 1<<40, 0, []int{4}, []int{1}), map[string][]byte{"0": good}, zip.Store), ErrFormat, "declares 1099511627776"},
		{"declared short of its entry", tp(3, 0, []int{3}, []int{1}), ErrFormat, "entry holds 16 bytes"},
		{"no such storage", torchZip(t, tensorPickle("FloatStorage", 4, 0, []int{4}, []int{1}), nil, zip.Store), ErrFormat, "no entry"},
		{"compressed storage", torchZip(t, tensorPickle("FloatStorage", 4, 0, []int{4}, []int{1}), map[string][]byte{"0": good}, zip.Deflate), ErrFormat, "compressed"},
		{"view past its storage", tp(4, 2, []int{3}, []int{1}), ErrFormat, "reaches past"},
		{"more elements than storage", tp(4, 0, []int{8}, []int{0}), ErrFormat, "more elements"},
		{"huge view", tp(4, 0, []int{1 << 30, 1 << 30}, []int{1, 1}), ErrFormat, "more elements"},
		{"negative stride", tp(4, 3, []int{4}, []int{-1}), ErrFormat, "stride"},
		{"offset past", tp(4, 9, []int{}, []int{}), ErrFormat, "offset 9"},
		{"backward hooks", torchZip(t, hooks, map[string][]byte{"0": good}, zip.Store), ErrUnsafe, "backward hooks"},
		{"string longer than the pickle", withPickle((&pk{}).op(0x80, 2, 'X', 0xff, 0xff, 0xff, 0x7f, 'a', '.').Bytes()), ErrFormat, "runs past the end"},
		{"frame larger than the pickle", withPickle((&pk{}).op(0x80, 4, 0x95, 0, 0, 0, 0, 0, 0, 0, 0x40, '.').Bytes()), ErrFormat, "runs past the end"},
		{"long integer", withPickle((&pk{}).op(0x80, 2, 0x8b, 0, 0, 1, 0).Bytes()), ErrFormat, "integer of 65536 bytes"},
		{"unknown opcode", withPickle([]byte{0x80, 2, 0xff, '.'}), ErrFormat, "unknown opcode"},
		{"no stop", withPickle([]byte{0x80, 2, 'N'}), ErrFormat, "no STOP"},
		{"odd SETITEMS (gopickle panics)", withPickle([]byte{0x80, 2, '}', '(', 'K', 1, 'u', '.'}), ErrFormat, "malformed"},
		{"nested marks", withPickle(append(bytes.Repeat([]byte{'('}, 2000), '.')), ErrFormat, "nested marks"},
		{"big-endian", bigEndian, ErrUnsupported, "byteorder"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := decodeBytes(c.in)
			var e *Error
			if !errors.Is(err, c.kind) || !errors.As(err, &e) || !strings.Contains(err.Error(), c.say) {
				t.Errorf("got %v; want %v saying %q", err, c.kind, c.say)
			}
		})
	}
}
