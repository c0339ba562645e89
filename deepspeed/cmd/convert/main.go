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
//
//	go run ./cmd/convert DIR -zero OUT
//
// writes the checkpoint as a zero checkpoint into OUT (OUT/step-N and
// OUT/latest), which Engine.Load and cmd/train -resume take at any world
// size, stage and bucket size: the master weights, moments and step
// counts, the groups' settings, the loss scaler, the schedule's step, and
// DeepSpeed's step and sample counters as rank 0's client bytes. Frozen
// parameters and buffers are the model's, not the optimizer's: a zero
// checkpoint holds none, so load them with the model (-o writes them).
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
	zeroOut := fs.String("zero", "", "write a zero checkpoint into this `dir`, for Engine.Load and cmd/train -resume")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: convert DIR -o FILE [-optimizer]\n       convert DIR -zero OUT")
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
	if *out == "" && *zeroOut == "" {
		fs.Usage()
		return 2
	}
	s, err := deepspeed.Read(pos[0])
	if err != nil {
		fmt.Fprintln(stderr, "convert:", err)
		return 1
	}
	if *zeroOut != "" {
		if err := deepspeed.WriteZero(s, *zeroOut); err != nil {
			fmt.Fprintln(stderr, "convert:", err)
			return 1
		}
		trained, frozen := 0, []string{}
		for _, p := range s.Params {
			if p.Frozen {
				frozen = append(frozen, p.Name)
			} else {
				trained++
			}
		}
		fmt.Fprintf(stdout, "%s: ZeRO-%d, %d ranks, %d trained parameters after %d steps (DeepSpeed %s) -> zero checkpoint %s\n", s.Dir, s.Stage, s.World, trained, s.GlobalSteps, s.DSVersion, *zeroOut)
		if len(frozen) > 0 || len(s.Buffers) > 0 {
			fmt.Fprintf(stdout, "not in it, as in any zero checkpoint: frozen parameters %v and %d buffer(s), which the model holds (-o writes them)\n", frozen, len(s.Buffers))
		}
		if *out == "" {
			return 0
		}
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
