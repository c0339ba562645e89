package deepspeed

import (
	"archive/zip"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/nlpodyssey/gopickle/types"
)

// The fuzz targets feed the reader damaged files: truncated zips, wrong
// pickles, classes outside the allow-list, storages declared far beyond
// their entries. Whatever the input, no panic escapes, every error is a
// typed *Error of one of the reader's kinds, and the bytes allocated stay
// within a constant times the input's size.
//
//	go test -run '^$' -fuzz FuzzTorchFile -fuzztime 5m -parallel 1 .

// allocBound is the most a decode may allocate for an input of n bytes:
// the storages once (n), their copies (2n, the materialize budget), the
// unpickled objects (tens of bytes per pickle byte) and a fixed part.
func allocBound(n int) uint64 { return 128*uint64(n) + 4<<20 }

func checkTyped(t *testing.T, err error) {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("an untyped error: %v", err)
	}
	for _, k := range []error{ErrFormat, ErrUnsafe, ErrLegacy, ErrUnsupported, ErrInconsistent} {
		if e.Kind == k {
			return
		}
	}
	t.Fatalf("an error of no kind: %v", err)
}

// seeds are inputs to start from: golden files of every stage and dtype,
// a universal-layout file, and hand-made bad ones.
func seeds(tb testing.TB) [][]byte {
	var out [][]byte
	for _, p := range []string{
		"z1-fp16/ckpt/global_step3/mp_rank_00_model_states.pt",
		"z1-fp16/ckpt/global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
		"z2-bf16/ckpt/global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
		"z3-fp32/ckpt/global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt",
		"z3-bf16/ckpt/global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
		"z2-fp32/ckpt/global_step3_universal/zero/fc2.bias/exp_avg.pt",
	} {
		b, err := os.ReadFile(filepath.Join(golden, p))
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, b, b[:len(b)/2], b[:len(b)-30])
	}
	good := float32Bytes([]float32{1, 2, 3, 4})
	out = append(out,
		torchZip(tb, tensorPickle("FloatStorage", 4, 0, []int{2, 2}, []int{1, 2}), map[string][]byte{"0": good}, zip.Store),
		torchZip(tb, tensorPickle("FloatStorage", 1<<40, 0, []int{4}, []int{1}), map[string][]byte{"0": good}, zip.Store),
		torchZip(tb, tensorPickle("HalfStorage", 8, 0, []int{1 << 20}, []int{0}), map[string][]byte{"0": good}, zip.Store),
		torchZip(tb, (&pk{}).op(0x80, 2).global("os", "system").str("true").op(0x85, 'R', '.').Bytes(), nil, zip.Store),
		torchZip(tb, []byte{0x80, 2, 'X', 0xff, 0xff, 0xff, 0x7f, '.'}, nil, zip.Store),
		torchZip(tb, []byte{0x80, 2, '}', '(', 'K', 1, 'u', '.'}, nil, zip.Store),
		[]byte{0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, '.'},
	)
	return out
}

func FuzzTorchFile(f *testing.F) {
	for _, s := range seeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		tf, err := decodeBytes(in)
		if err == nil {
			// copy out every tensor the pickle reaches, as a reader would
			r := &reader{}
			budget := 1 << 16
			eachTensor(tf.root, map[any]bool{}, &budget, func(v *tensorView) {
				if _, err := r.tensor(tf, v, "t", nil); err != nil {
					checkTyped(t, err)
				}
			})
		} else {
			checkTyped(t, err)
		}
		runtime.ReadMemStats(&after)
		if got := after.TotalAlloc - before.TotalAlloc; got > allocBound(len(in)) {
			t.Fatalf("allocated %d bytes for an input of %d", got, len(in))
		}
	})
}

// eachTensor visits the tensors a value reaches, each container once.
func eachTensor(v any, seen map[any]bool, budget *int, visit func(*tensorView)) {
	if *budget--; *budget < 0 {
		return
	}
	switch x := v.(type) {
	case *tensorView:
		visit(x)
		return
	case *types.Dict, *types.OrderedDict, *types.List, *types.Tuple, *pyObject:
		if seen[x] {
			return
		}
		seen[x] = true
	}
	switch x := v.(type) {
	case *types.Dict:
		for _, e := range *x {
			eachTensor(e.Value, seen, budget, visit)
		}
	case *types.OrderedDict:
		for el := x.List.Front(); el != nil; el = el.Next() {
			eachTensor(el.Value.(*types.OrderedDictEntry).Value, seen, budget, visit)
		}
	case *types.List:
		for _, it := range *x {
			eachTensor(it, seen, budget, visit)
		}
	case *types.Tuple:
		for _, it := range *x {
			eachTensor(it, seen, budget, visit)
		}
	case *pyObject:
		for _, a := range x.attrs {
			eachTensor(a, seen, budget, visit)
		}
	}
}

// FuzzCheckpoint puts the input in place of one file of a golden
// checkpoint (a ZeRO-2 fp16 one, a ZeRO-3 bf16 one, or a universal
// layout: which picks the checkpoint and the file) and reads the whole
// checkpoint.
func FuzzCheckpoint(f *testing.F) {
	type source struct {
		files map[string][]byte // every file, by path in the checkpoint
		names []string          // in order
	}
	var sources []source
	total := 0
	for _, dir := range []string{"z2-fp16/ckpt/global_step3", "z3-bf16/ckpt/global_step3", "z1-fp16/ckpt/global_step3_universal"} {
		src := source{files: map[string][]byte{}}
		root := filepath.Join(golden, dir)
		err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			rel, _ := filepath.Rel(root, path)
			b, err := os.ReadFile(path)
			src.files[rel], src.names = b, append(src.names, rel)
			total += len(b)
			return err
		})
		if err != nil {
			f.Fatal(err)
		}
		sources = append(sources, src)
	}
	for i, src := range sources {
		for j, n := range src.names {
			b := src.files[n]
			which := uint16(i + len(sources)*j)
			f.Add(which, b)
			f.Add(which, b[:len(b)-100])
			f.Add(which, src.files[src.names[(j+1)%len(src.names)]])
		}
	}
	f.Fuzz(func(t *testing.T, which uint16, in []byte) {
		src := sources[int(which)%len(sources)]
		victim := src.names[int(which)/len(sources)%len(src.names)]
		dir := t.TempDir()
		for _, n := range src.names {
			b := src.files[n]
			if n == victim {
				b = in
			}
			os.MkdirAll(filepath.Dir(filepath.Join(dir, n)), 0o755)
			if err := os.WriteFile(filepath.Join(dir, n), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		s, err := Read(dir)
		runtime.ReadMemStats(&after)
		if err != nil {
			checkTyped(t, err)
			if s != nil {
				t.Fatal("a State with an error")
			}
		}
		if got := after.TotalAlloc - before.TotalAlloc; got > allocBound(total+len(in)) {
			t.Fatalf("allocated %d bytes for files of %d", got, total+len(in))
		}
	})
}
