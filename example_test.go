package zero_test

import (
	"fmt"

	"zero"
)

// Two ranks in one process reduce the gradients of a two-parameter model
// over two backwards. Each rank keeps its shard of the mean gradient and
// reads its part of parameter w through a view.
func Example() {
	params := []zero.Param{
		{Name: "w", Count: 6, DType: zero.FP32},
		{Name: "b", Count: 2, DType: zero.FP32},
	}
	out := make([]string, 2)
	// RunLocal runs one goroutine per rank of an in-process group, joins
	// their errors, and aborts the others as soon as one fails.
	err := zero.RunLocal(2, func(comm zero.Comm) error {
		var err error
		out[comm.Rank()], err = trainStep(comm, params)
		return err
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Print(out[0], out[1])
	// Output:
	// rank 0: w[0:1] = [2.25]
	// rank 1: w[1:6] = [4.5 6.75 9 11.25 13.5]
}

// trainStep is one rank's step: two backwards, Step, and a read of its part
// of w's gradient.
func trainStep(comm zero.Comm, params []zero.Param) (string, error) {
	// Align 1 lets this tiny model split across both ranks; the default
	// (64 elements) suits real models.
	e, err := zero.New(zero.Config{Stage: 2, BucketBytes: 1 << 20, Align: 1}, comm, params)
	if err != nil {
		return "", err
	}
	defer e.Close()
	stream := zero.NewHostStream() // the stream the framework's backward runs on
	defer stream.Close()

	for k := 1; k <= 2; k++ {
		// Backward yields gradients in reverse registration order. Here
		// element i of every gradient is k·(rank+1)·(i+1).
		for p := len(params) - 1; p >= 0; p-- {
			g := make([]float32, params[p].Count)
			for i := range g {
				g[i] = float32(k * (comm.Rank() + 1) * (i + 1))
			}
			if _, err := e.GradReady(p, zero.Float32s(g), stream); err != nil {
				return "", err
			}
		}
		if err := e.EndBackward(); err != nil {
			return "", err
		}
	}
	// The mean over 2 ranks and 2 backwards: (1+2)·(1+2)·(i+1)/4.
	if err := e.Step(); err != nil {
		return "", err
	}
	w, err := e.GradView(0)
	if err != nil {
		return "", err
	}
	got := make([]float32, w.Count)
	if err := w.Read(got); err != nil {
		return "", err
	}
	return fmt.Sprintf("rank %d: w[%d:%d] = %v\n", e.Rank(), w.ParamOffset, w.ParamOffset+w.Count, got), nil
}
