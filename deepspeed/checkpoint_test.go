package deepspeed

import (
	"archive/zip"
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// copyRun copies a golden run's checkpoint directory (global_step3) into
// a temporary directory and returns the copy's path.
func copyRun(t *testing.T, run string) string {
	t.Helper()
	src := filepath.Join(golden, run, "ckpt", "global_step3")
	dst := filepath.Join(t.TempDir(), "global_step3")
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, path)
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

// rewritePickle rewrites a PyTorch file with its data.pkl edited, every
// other entry as it was (stored, so the CRCs stay right).
func rewritePickle(t *testing.T, path string, edit func([]byte) []byte) {
	t.Helper()
	zr, err := zip.OpenReader(path)
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	w := zip.NewWriter(&b)
	edited := false
	for _, f := range zr.File {
		rc, err := f.Open()
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(rc)
		rc.Close()
		if strings.HasSuffix(f.Name, "/data.pkl") {
			n := edit(data)
			edited = !bytes.Equal(n, data)
			data = n
		}
		fw, err := w.CreateHeader(&zip.FileHeader{Name: f.Name, Method: zip.Store})
		if err != nil {
			t.Fatal(err)
		}
		fw.Write(data)
	}
	zr.Close()
	w.Close()
	if !edited {
		t.Fatalf("%s: the edit changed nothing", path)
	}
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

func rename(t *testing.T, dir, from, to string) {
	t.Helper()
	if err := os.Rename(filepath.Join(dir, from), filepath.Join(dir, to)); err != nil {
		t.Fatal(err)
	}
}

func copyFile(t *testing.T, dir, from, to string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, from))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, to), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

const (
	optim0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
	optim1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
	modelF = "mp_rank_00_model_states.pt"
)

// TestReadRefusals: what zero cannot continue is refused naming it, and
// files that are not what their names say are found; Read returns no
// State with any error.
func TestReadRefusals(t *testing.T) {
	for _, c := range []struct {
		name string
		run  string
		edit func(t *testing.T, dir string)
		kind error
		say  string
	}{
		{"zero-3 rank missing", "z3-fp32", func(t *testing.T, dir string) {
			os.Remove(filepath.Join(dir, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
		}, ErrInconsistent, "1 model-states files for a data-parallel world of 2"},
		{"zero-3 beside zero-2", "z3-fp32", func(t *testing.T, dir string) {
			b, _ := os.ReadFile(filepath.Join(golden, "z2-fp32", "ckpt", "global_step3", modelF))
			os.WriteFile(filepath.Join(dir, modelF), b, 0o644)
		}, ErrInconsistent, "files of two saves"},
		{"zero-3 MiCS", "z3-fp32", func(t *testing.T, dir string) {
			rewritePickle(t, filepath.Join(dir, optim0), func(p []byte) []byte {
				// the config's zero_optimization dict gets mics_shard_size 2
				i := bytes.Index(p, []byte("X\x11\x00\x00\x00zero_optimization"))
				j := i + bytes.IndexByte(p[i:], '}') + 1
				if p[j] == 'q' { // BINPUT
					j += 2
				}
				out := append([]byte(nil), p[:j]...)
				out = append(out, "X\x0f\x00\x00\x00mics_shard_sizeK\x02s"...)
				return append(out, p[j:]...)
			})
		}, ErrUnsupported, "MiCS"},
		{"ranks swapped", "z2-fp32", func(t *testing.T, dir string) {
			rename(t, dir, optim0, "x")
			rename(t, dir, optim1, optim0)
			rename(t, dir, "x", optim1)
		}, ErrInconsistent, "not rank 0's file"},
		{"rank missing", "z1-fp32", func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, optim1)) }, ErrInconsistent, "1 optimizer files for a data-parallel world of 2"},
		{"rank 1 missing, rank 2 there", "z1-fp32", func(t *testing.T, dir string) {
			rename(t, dir, optim1, "zero_pp_rank_2_mp_rank_00_optim_states.pt")
		}, ErrInconsistent, "no optimizer file for rank 1"},
		{"named bf16 but fp32", "z2-fp32", func(t *testing.T, dir string) {
			rename(t, dir, optim0, "bf16_"+optim0)
			rename(t, dir, optim1, "bf16_"+optim1)
		}, ErrInconsistent, "not what its name says"},
		{"both prefixes", "z2-fp32", func(t *testing.T, dir string) { rename(t, dir, optim1, "bf16_"+optim1) }, ErrInconsistent, "two saves"},
		{"model file as an optimizer file", "z2-fp32", func(t *testing.T, dir string) { copyFile(t, dir, modelF, optim1) }, ErrInconsistent, "not an optimizer-states file"},
		{"optimizer file as the model file", "z2-fp32", func(t *testing.T, dir string) { copyFile(t, dir, optim0, modelF) }, ErrInconsistent, "not a model-states file"},
		{"tensor parallel", "z2-fp32", func(t *testing.T, dir string) { copyFile(t, dir, modelF, "mp_rank_01_model_states.pt") }, ErrUnsupported, "tensor-parallel"},
		{"pipeline parallel", "z2-fp32", func(t *testing.T, dir string) { copyFile(t, dir, modelF, "layer_01-model_00-model_states.pt") }, ErrUnsupported, "pipeline-parallel"},
		{"experts", "z2-fp32", func(t *testing.T, dir string) { copyFile(t, dir, optim0, "expp_rank_0_mp_rank_00_optim_states.pt") }, ErrUnsupported, "mixture-of-experts"},
		{"optimizer zero lacks", "z2-fp32", func(t *testing.T, dir string) {
			rewritePickle(t, filepath.Join(dir, optim0), func(p []byte) []byte {
				return bytes.Replace(p, []byte("X\x05\x00\x00\x00AdamW"), []byte("X\x05\x00\x00\x00Lion!"), -1)
			})
		}, ErrUnsupported, "optimizer Lion!"},
		{"Adam with L2 decay", "z1-bf16", func(t *testing.T, dir string) {
			rewritePickle(t, filepath.Join(dir, "bf16_"+optim0), func(p []byte) []byte {
				p = bytes.Replace(p, []byte("X\x05\x00\x00\x00AdamW"), []byte("X\x04\x00\x00\x00Adam"), -1)
				// {'torch_adam': True} becomes {'adam_w_mode': False}
				key := []byte("X\x0a\x00\x00\x00torch_adam")
				i := bytes.Index(p, key)
				j := i + len(key)
				if p[j] == 'q' { // BINPUT
					j += 2
				}
				if i < 0 || p[j] != 0x88 {
					t.Fatal("no torch_adam: True in the pickle")
				}
				out := append([]byte(nil), p[:i]...)
				out = append(out, "X\x0b\x00\x00\x00adam_w_mode"...)
				out = append(out, p[i+len(key):j]...)
				out = append(out, 0x89)
				return append(out, p[j+1:]...)
			})
		}, ErrUnsupported, "adam_w_mode false"},
		{"a damaged storage", "z2-bf16", func(t *testing.T, dir string) {
			b, _ := os.ReadFile(filepath.Join(dir, "bf16_"+optim1))
			i := bytes.Index(b, []byte("data/1"))
			b[i+200] ^= 0xff // in the storage's bytes: the CRC finds it
			os.WriteFile(filepath.Join(dir, "bf16_"+optim1), b, 0o644)
		}, ErrFormat, "checksum"},
		{"not a directory", "z2-fp32", func(t *testing.T, dir string) { os.RemoveAll(dir) }, ErrInconsistent, "no such file"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(golden, c.run, "ckpt")
			if c.edit != nil {
				dir = copyRun(t, c.run)
				c.edit(t, dir)
			}
			s, err := Read(dir)
			var e *Error
			if s != nil || !errors.Is(err, c.kind) || !errors.As(err, &e) || !strings.Contains(err.Error(), c.say) {
				t.Errorf("got %v (state %v); want %v saying %q", err, s != nil, c.kind, c.say)
			}
		})
	}
}

// TestReadEditedStillReads: the edits the refusal tests make are sound:
// the same rewrite that changes nothing of meaning reads as before.
func TestReadEditedStillReads(t *testing.T) {
	dir := copyRun(t, "z2-fp32")
	rewritePickle(t, filepath.Join(dir, optim0), func(p []byte) []byte {
		return bytes.Replace(p, []byte("X\x05\x00\x00\x00AdamW"), []byte("X\x05\x00\x00\x00adamw"), -1)
	})
	if _, err := Read(dir); err != nil {
		t.Fatal(err)
	}
}

// TestCheckSlices: a rank's param_slice_mappings are held to the layout,
// so a file standing in for another rank's is found even where the
// partition sizes agree.
func TestCheckSlices(t *testing.T) {
	dir := filepath.Join(golden, "z2-fp32", "ckpt", "global_step3")
	m, err := openTorchFile(filepath.Join(dir, modelF))
	if err != nil {
		t.Fatal(err)
	}
	r := &reader{dir: dir}
	if _, err := r.modelStates(m); err != nil {
		t.Fatal(err)
	}
	var ranks []*optimFile
	for i, name := range []string{optim0, optim1} {
		f, err := openTorchFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		o, err := r.optimFile(f, i, false)
		if err != nil {
			t.Fatal(err)
		}
		ranks = append(ranks, o)
	}
	l, err := r.layout(0, ranks)
	if err != nil {
		t.Fatal(err)
	}
	// group 0's partitions are 180 elements on both ranks
	if r0, r1 := ranks[0].fp32[0].numel, ranks[1].fp32[0].numel; r0 != r1 {
		t.Fatalf("group 0 partitions %d and %d", r0, r1)
	}
	if err := r.checkSlices(0, ranks[0], l); err != nil {
		t.Fatal(err)
	}
	ranks[1].rank = 0
	if err := r.checkSlices(0, ranks[1], l); !errors.Is(err, ErrInconsistent) {
		t.Errorf("rank 1's mappings as rank 0's: %v", err)
	}
}

// TestLayoutAlignmentPaddings: param_alignment_paddings (DeepSpeed's
// parameter_alignment, off in the golden runs) move the later parameters
// and count in the group's length, as zero_to_fp32 counts them.
func TestLayoutAlignmentPaddings(t *testing.T) {
	// W=2, sizes 3 and 5, one element of padding after the first: offsets
	// 0 and 4, 9 elements, padded to 12 (a multiple of 2·W), 6 per rank
	r := &reader{dir: "x", shapes: [][]kv{{{"a", torchSize{3}}, {"b", torchSize{5}}}}}
	view := func(n int) *tensorView { return &tensorView{st: &storage{dtype: Float32}, numel: n, shape: []int{n}} }
	ranks := []*optimFile{
		{rank: 0, fp32: []*tensorView{view(6)}, paddings: []int{0}, align: [][]int{{1, 0}}},
		{rank: 1, fp32: []*tensorView{view(3)}, paddings: []int{3}, align: [][]int{{1, 0}}},
	}
	l, err := r.layout(0, ranks)
	if err != nil {
		t.Fatal(err)
	}
	if l.offsets[0] != 0 || l.offsets[1] != 4 || l.unpadded != 9 || l.part != 6 {
		t.Errorf("layout %+v, want offsets [0 4], 9 elements, 6 per rank", l)
	}
	ranks[1].fp32[0] = view(2) // as if the padding were not counted
	if _, err := r.layout(0, ranks); !errors.Is(err, ErrInconsistent) {
		t.Errorf("a partition one short: %v", err)
	}
}

// withConfigKey is a pickle with zero_optimization.key = n (a small int)
// added to the ds_config it holds.
func withConfigKey(t *testing.T, key string, n byte) func([]byte) []byte {
	return func(p []byte) []byte {
		i := bytes.Index(p, []byte("X\x11\x00\x00\x00zero_optimization"))
		if i < 0 {
			t.Fatal("no zero_optimization in the pickle")
		}
		j := i + bytes.IndexByte(p[i:], '}') + 1
		if p[j] == 'q' { // BINPUT
			j += 2
		}
		out := append([]byte(nil), p[:j]...)
		out = append(out, 'X', byte(len(key)), 0, 0, 0)
		out = append(out, key...)
		out = append(out, 'K', n, 's')
		return append(out, p[j:]...)
	}
}

// TestReadRefusesLayouts: a ZeRO-3 run with ZeRO++'s hierarchical
// partitioning or MiCS's shard groups is refused (ErrUnsupported, naming
// it), from its checkpoint (MiCS: TestReadRefusals) and from the universal
// layout ds_to_universal made of it (which reads such a run as a plain
// one, wrongly); a value that keeps the plain layout is read.
func TestReadRefusesLayouts(t *testing.T) {
	for _, c := range []struct {
		name, sub, file, key string
		n                    byte
		say                  string
	}{
		{"hpZ", "global_step3", "bf16_" + optim0, "zero_hpz_partition_size", 2, "ZeRO++ hierarchical partitioning"},
		{"hpZ, universal", "global_step3_universal", "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_hpz_partition_size", 4, "ZeRO++"},
		{"MiCS, universal", "global_step3_universal", "zero_pp_rank_0_mp_rank_00_model_states.pt", "mics_shard_size", 1, "zero_optimization.mics_shard_size 1: MiCS"},
		{"hpZ of 1", "global_step3", "bf16_" + optim0, "zero_hpz_partition_size", 1, ""},
		{"MiCS off, universal", "global_step3_universal", "zero_pp_rank_0_mp_rank_00_model_states.pt", "mics_shard_size", 0, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := copyTreeOf(t, filepath.Join(golden, "z3-bf16", "ckpt", c.sub))
			rewritePickle(t, filepath.Join(dir, c.file), withConfigKey(t, c.key, c.n))
			s, err := Read(dir)
			if c.say == "" {
				if err != nil {
					t.Fatalf("%s %d keeps the plain layout: %v", c.key, c.n, err)
				}
				return
			}
			var e *Error
			if s != nil || !errors.Is(err, ErrUnsupported) || !errors.As(err, &e) || !strings.Contains(err.Error(), c.say) {
				t.Errorf("got %v (state %v); want ErrUnsupported saying %q", err, s != nil, c.say)
			}
		})
	}
}

// copyTreeOf copies the directory src into a temporary one.
func copyTreeOf(t *testing.T, src string) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), filepath.Base(src))
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, path)
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}
