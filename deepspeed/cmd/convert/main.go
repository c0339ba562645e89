// Command convert reads a DeepSpeed ZeRO checkpoint and writes its
// fp32 weights as one safetensors file with DeepSpeed's tensor names,
// byte for byte what zero_to_fp32.py writes, without Python:
//
//	cd deepspeed && go run ./cmd/convert DIR -o model.safetensors
//	go run ./cmd/convert DIR -o state.safetensors -optimizer
//
// DIR is the directory save_checkpoint was given (its latest file names
// the tag), a global_stepN directory, or ds_to_universal's output.
// -optimizer adds Adam's state as torch and zero's own export name it
// (NAME.exp_avg, NAME.exp_avg_sq, NAME.step), and each group's
// hyperparameters and step as the file's "deepspeed_optimizer" metadata.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"

	"zero/deepspeed"
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("convert", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("o", "", "write the fp32 weights to this safetensors `file`")
	opt := fs.Bool("optimizer", false, "add Adam's state (NAME.exp_avg, NAME.exp_avg_sq, NAME.step) and the groups' settings")
	zeroOut := fs.String("zero", "", "write a zero checkpoint to this `dir` (not available yet)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: convert DIR -o FILE [-optimizer]")
		fs.PrintDefaults()
	}
	// flags may come before or after DIR
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return 2
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if len(pos) != 1 {
		fs.Usage()
		return 2
	}
	if *zeroOut != "" {
		fmt.Fprintln(stderr, "convert: -zero is not available yet: writing a zero checkpoint needs zero's checkpoint writer, which this version of zero does not export; use -o for safetensors")
		return 2
	}
	if *out == "" {
		fs.Usage()
		return 2
	}
	s, err := deepspeed.Read(pos[0])
	if err != nil {
		fmt.Fprintln(stderr, "convert:", err)
		return 1
	}
	ts := deepspeed.FP32Tensors(s)
	meta := map[string]string{"format": "pt"}
	if *opt {
		moments, m := deepspeed.OptimizerTensors(s)
		ts = append(ts, moments...)
		for k, v := range m {
			meta[k] = v
		}
	}
	if err := deepspeed.WriteSafetensors(*out, ts, meta); err != nil {
		fmt.Fprintln(stderr, "convert:", err)
		return 1
	}
	fmt.Fprintf(stdout, "%s: ZeRO-%d, %d ranks, %d tensors (DeepSpeed %s) -> %s\n", s.Dir, s.Stage, s.World, len(ts), s.DSVersion, *out)
	return 0
}
