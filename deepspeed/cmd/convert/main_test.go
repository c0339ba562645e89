package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const golden = "../../testdata/golden"

// TestConvertCommand: the command's output is zero_to_fp32's file, byte
// for byte, with the flags before or after DIR.
func TestConvertCommand(t *testing.T) {
	for _, name := range []string{"z1-fp16", "z2-bf16"} {
		want, err := os.ReadFile(filepath.Join(golden, name, "zero_to_fp32", "model.safetensors"))
		if err != nil {
			t.Fatal(err)
		}
		for _, flagsFirst := range []bool{false, true} {
			out := filepath.Join(t.TempDir(), "model.safetensors")
			args := []string{filepath.Join(golden, name, "ckpt"), "-o", out}
			if flagsFirst {
				args = []string{"-o", out, filepath.Join(golden, name, "ckpt", "global_step3")}
			}
			var so, se bytes.Buffer
			if code := run(args, &so, &se); code != 0 {
				t.Fatalf("%v: exit %d: %s", args, code, se.String())
			}
			got, _ := os.ReadFile(out)
			if !bytes.Equal(got, want) {
				t.Errorf("%s %v: output differs from zero_to_fp32's", name, args)
			}
		}
	}
}

// TestConvertCommandErrors: usage, a refused checkpoint and -zero exit
// non-zero, naming why, and write nothing.
func TestConvertCommandErrors(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "x.safetensors")
	zout := filepath.Join(dir, "zero")
	for _, c := range []struct {
		args []string
		code int
		say  string
	}{
		{[]string{}, 2, "usage"},
		{[]string{filepath.Join(golden, "z1-fp32", "ckpt")}, 2, "usage"},
		{[]string{filepath.Join(golden, "z3-fp32", "ckpt", "zero"), "-o", out}, 1, "no such file"},
		{[]string{dir, "-o", out}, 1, "mp_rank_00_model_states.pt"},
		{[]string{dir, "-zero", zout}, 1, "mp_rank_00_model_states.pt"},
	} {
		var so, se bytes.Buffer
		if code := run(c.args, &so, &se); code != c.code || !strings.Contains(se.String(), c.say) {
			t.Errorf("%v: exit %d, %q; want %d and %q", c.args, code, se.String(), c.code, c.say)
		}
		for _, f := range []string{out, zout} {
			if _, err := os.Stat(f); err == nil {
				t.Errorf("%v wrote %s", c.args, f)
			}
		}
	}
}

// TestConvertCommandZero: -zero writes a zero checkpoint (its latest
// names step-00000003, whose manifest is zero's), says what it holds and
// what a zero checkpoint leaves to the model (the frozen parameter and
// the buffer), with -o beside it or not. The module's tests load it.
func TestConvertCommandZero(t *testing.T) {
	for _, withO := range []bool{false, true} {
		zout := filepath.Join(t.TempDir(), "zero")
		args := []string{filepath.Join(golden, "z3-bf16", "ckpt"), "-zero", zout}
		st := filepath.Join(t.TempDir(), "model.safetensors")
		if withO {
			args = append(args, "-o", st)
		}
		var so, se bytes.Buffer
		if code := run(args, &so, &se); code != 0 {
			t.Fatalf("%v: exit %d: %s", args, code, se.String())
		}
		latest, err := os.ReadFile(filepath.Join(zout, "latest"))
		if err != nil || string(latest) != "step-00000003\n" {
			t.Fatalf("latest %q (%v)", latest, err)
		}
		m, err := os.ReadFile(filepath.Join(zout, "step-00000003", "manifest.json"))
		if err != nil || !strings.Contains(string(m), `"format": "zero-checkpoint"`) {
			t.Fatalf("manifest %.80q (%v)", m, err)
		}
		for _, say := range []string{"ZeRO-3, 2 ranks, 5 trained parameters after 3 steps", "frozen parameters [frozen] and 1 buffer(s)"} {
			if !strings.Contains(so.String(), say) {
				t.Errorf("output %q does not say %q", so.String(), say)
			}
		}
		if _, err := os.Stat(st); err != nil && withO {
			t.Errorf("-o beside -zero: %v", err)
		}
	}
}
