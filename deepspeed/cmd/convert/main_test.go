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
	for _, c := range []struct {
		args []string
		code int
		say  string
	}{
		{[]string{}, 2, "usage"},
		{[]string{filepath.Join(golden, "z1-fp32", "ckpt")}, 2, "usage"},
		{[]string{filepath.Join(golden, "z3-fp32", "ckpt", "zero"), "-o", out}, 1, "no such file"},
		{[]string{filepath.Join(golden, "z1-fp32", "ckpt"), "-zero", dir}, 2, "-zero is not available"},
		{[]string{dir, "-o", out}, 1, "mp_rank_00_model_states.pt"},
	} {
		var so, se bytes.Buffer
		if code := run(c.args, &so, &se); code != c.code || !strings.Contains(se.String(), c.say) {
			t.Errorf("%v: exit %d, %q; want %d and %q", c.args, code, se.String(), c.code, c.say)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("%v wrote %s", c.args, out)
		}
	}
}
