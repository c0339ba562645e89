package zero_test

import (
	"fmt"

	"zero"
)

// The backward protocol on one rank: register, hand over each gradient as
// backward produces it (here from two streams), end the backward, step,
// and read the reduced fp32 shard.
func Example() {
	comms, _ := zero.NewLocalGroup(1)
	params := []zero.Param{{Name: "w", Count: 4, DType: zero.FP32}, {Name: "b", Count: 2, DType: zero.FP32}}
	e, err := zero.New(zero.Config{Stage: 2, BucketBytes: 1 << 20, Overlap: true}, comms[0], params)
	if err != nil {
		panic(err)
	}
	defer e.Close()
	s0, s1 := zero.NewHostStream(), zero.NewHostStream()
	defer s0.Close()
	defer s1.Close()

	// Backward yields gradients in reverse registration order.
	e.GradReady(1, zero.Float32s([]float32{0.5, -1}), s1)
	e.GradReady(0, zero.Float32s([]float32{1, 2, 3, 4}), s0)
	if err := e.EndBackward(); err != nil {
		panic(err)
	}
	if err := e.Step(); err != nil {
		panic(err)
	}
	shard, _ := e.GradShard()
	fmt.Println(shard[:6]) // bucket layout: b, then w
	// Output: [0.5 -1 1 2 3 4]
}
