//go:build cuda

package zero

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestCUDASafetensorsRoundTrip: on the GPU (or the fake driver), a file
// imported into device memory (Data at stage 2, Init at stage 3, a frozen
// parameter's Data) and exported again by two ranks of the one-GPU group
// is the same file, byte for byte: the imports' copies to the device, the
// export's copies of device state through its chunk (a parameter larger
// than one chunk per rank) and the frozen parameter's copy and widening.
func TestCUDASafetensorsRoundTrip(t *testing.T) {
	d := needCUDA(t)
	seed := testSeed(t)
	shapes := []struct {
		name   string
		shape  []int
		frozen bool
	}{{"big", []int{5 << 20}, false}, {"frozen", []int{1200, 1000}, true}, {"small", []int{7, 9}, false}}
	dir := t.TempDir()
	src := filepath.Join(dir, "in.safetensors")
	var ts []stTensor
	for _, s := range shapes {
		ts = append(ts, stTensor{Name: s.name, DType: "F32", Shape: s.shape})
	}
	h, head, err := layoutST(ts, map[string]string{"format": "pt", "zero.step": "0"})
	if err != nil {
		t.Fatal(err)
	}
	file := make([]byte, h.Size())
	copy(file, head)
	x := uint64(seed)
	for i := len(head); i+4 <= len(file); i += 4 {
		x = x*6364136223846793005 + 1442695040888963407
		binary.LittleEndian.PutUint32(file[i:], math.Float32bits(float32(int32(x>>32))*0x1p-31))
	}
	if err := os.WriteFile(src, file, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, stage := range []int{2, 3} {
		out := filepath.Join(dir, fmt.Sprintf("out-%d.safetensors", stage))
		comms, err := NewCUDALocalGroupTimeout(2, d, 60*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		errs := eachRank(2, func(rank int) error {
			defer comms[rank].Close()
			ps := make([]Param, len(shapes))
			for p, s := range shapes {
				n := 1
				for _, k := range s.shape {
					n *= k
				}
				ps[p] = Param{Name: s.name, Shape: s.shape, Count: n, DType: FP32, Frozen: s.frozen}
				if stage < 3 || s.frozen {
					mem, err := d.Alloc(n, FP32)
					if err != nil {
						return err
					}
					defer d.Free(mem)
					ps[p].Data = mem
				}
			}
			if err := ImportSafetensors(src, Config{Stage: stage}, d, ps, ImportOptions{}); err != nil {
				return err
			}
			e, err := New(Config{Stage: stage, BucketBytes: 1 << 20, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}, comms[rank], ps)
			if err != nil {
				return err
			}
			defer e.Close()
			return e.ExportSafetensors(out, ExportOptions{})
		})
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("stage %d: %v", stage, err)
		}
		got, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, file) {
			t.Fatalf("stage %d: the export differs from the imported file (%d and %d bytes)", stage, len(got), len(file))
		}
	}
}
