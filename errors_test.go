package zero

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
)

func TestConfigErrors(t *testing.T) {
	comms, _ := NewLocalGroup(1)
	params := []Param{{Name: "w", Count: 10, DType: BF16}}
	for name, tc := range map[string]struct {
		cfg    Config
		params []Param
		want   error
	}{
		"stage 0":        {Config{Stage: 0, BucketBytes: 1024}, params, ErrConfig},
		"stage 4":        {Config{Stage: 4, BucketBytes: 1024}, params, ErrConfig},
		"bucket 0":       {Config{Stage: 2}, params, ErrConfig},
		"bucket <0":      {Config{Stage: 2, BucketBytes: -1}, params, ErrConfig},
		"predivide <0":   {Config{Stage: 2, BucketBytes: 1024, Grads: GradPolicy{PredivideFactor: -2}}, params, ErrConfig},
		"predivide NaN":  {Config{Stage: 2, BucketBytes: 1024, Grads: GradPolicy{PredivideFactor: math.NaN()}}, params, ErrConfig},
		"accum <0":       {Config{Stage: 2, BucketBytes: 1024, Grads: GradPolicy{AccumSteps: -1}}, params, ErrConfig},
		"comm fp16":      {Config{Stage: 2, BucketBytes: 1024, Precision: PrecisionPolicy{CommDType: FP16}}, params, ErrConfig},
		"no params":      {Config{Stage: 2, BucketBytes: 1024}, nil, ErrParam},
		"negative count": {Config{Stage: 2, BucketBytes: 1024}, []Param{{Count: -1, DType: FP32}}, ErrParam},
		"bad dtype":      {Config{Stage: 2, BucketBytes: 1024}, []Param{{Count: 1}}, ErrDType},
		"mixed dtypes":   {Config{Stage: 2, BucketBytes: 1024}, []Param{{Count: 1, DType: FP32}, {Count: 1, DType: BF16}}, ErrDType},
	} {
		if _, err := New(tc.cfg, comms[0], tc.params); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", name, err, tc.want)
		}
	}
	if _, err := New(DefaultConfig(), nil, params); !errors.Is(err, ErrConfig) {
		t.Errorf("nil comm: %v, want ErrConfig", err)
	}
	if _, err := NewLocalGroup(0); !errors.Is(err, ErrConfig) {
		t.Errorf("world 0: %v, want ErrConfig", err)
	}
}

// TestTensorWithinItsMemory: a Tensor that claims more bytes than the Go
// slice it views (3 fp32 elements over 6 bytes of 16-bit values) is refused
// before the engine reads past the slice, as a gradient and as a
// parameter's Data.
func TestTensorWithinItsMemory(t *testing.T) {
	comms, _ := NewLocalGroup(1)
	params := []Param{{Name: "a", Count: 3, DType: FP32}}
	e, err := New(Config{Stage: 2, BucketBytes: 1 << 20}, comms[0], params)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	x := make([]uint16, 5)
	if _, err := e.GradReady(0, Halfs(x[:3], FP32), s); !errors.Is(err, ErrDType) || !strings.Contains(err.Error(), "Float32s") {
		t.Errorf("Halfs as fp32: %v, want ErrDType naming Float32s", err)
	}
	if _, err := e.GradReady(0, Halfs(x, FP32).slice(2, 3), s); !errors.Is(err, ErrDType) {
		t.Errorf("a slice past the end of its memory: %v, want ErrDType", err)
	}
	params[0].Data = Halfs(x[:3], FP32)
	if _, err := New(Config{Stage: 2, BucketBytes: 1 << 20, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewSGD(1)}}}, comms[0], params); !errors.Is(err, ErrDType) {
		t.Errorf("Data of Halfs as fp32: %v, want ErrDType", err)
	}
}

// TestGradReadyErrors: bad gradients are refused with a typed error, and
// nothing is lost: the right gradient reported afterwards gives the right
// result.
func TestGradReadyErrors(t *testing.T) {
	for _, stage := range []int{1, 2, 3} {
		comms, _ := NewLocalGroup(1)
		params := []Param{{Name: "a", Count: 8, DType: BF16}, {Name: "b", Count: 3, DType: BF16}}
		e, err := New(Config{Stage: stage, BucketBytes: 1 << 20}, comms[0], params)
		if err != nil {
			t.Fatal(err)
		}
		s := NewHostStream()
		good := []uint16{bf16FromFloat(1), bf16FromFloat(2), bf16FromFloat(3)}
		for name, tc := range map[string]struct {
			param int
			grad  Tensor
			s     Stream
			want  error
		}{
			"size":         {1, Halfs(make([]uint16, 4), BF16), s, ErrGradSize},
			"dtype":        {1, Float32s(make([]float32, 3)), s, ErrDType},
			"param range":  {2, Halfs(good, BF16), s, ErrParam},
			"negative":     {-1, Halfs(good, BF16), s, ErrParam},
			"nil stream":   {1, Halfs(good, BF16), nil, ErrStream},
			"wrong stream": {1, Halfs(good, BF16), fakeStream{}, ErrStream},
			"unset dtype":  {1, Halfs(good, 0), s, ErrDType},
		} {
			if _, err := e.GradReady(tc.param, tc.grad, tc.s); !errors.Is(err, tc.want) {
				t.Errorf("stage %d %s: %v, want %v", stage, name, err, tc.want)
			}
		}
		// A batch with one bad gradient is refused whole.
		if _, err := e.GradsReady([]int{1, 0}, []Tensor{Halfs(good, BF16), Halfs(good, BF16)}, s); !errors.Is(err, ErrGradSize) {
			t.Errorf("stage %d: batch with a bad gradient: %v, want ErrGradSize", stage, err)
		}
		if _, err := e.GradsReady([]int{1, 1}, []Tensor{Halfs(good, BF16), Halfs(good, BF16)}, s); !errors.Is(err, ErrDuplicateGrad) {
			t.Errorf("stage %d: a parameter twice in a batch: %v, want ErrDuplicateGrad", stage, err)
		}
		if _, err := e.GradsReady([]int{1}, nil, s); !errors.Is(err, ErrParam) {
			t.Errorf("stage %d: batch of mismatched lengths: %v, want ErrParam", stage, err)
		}
		if _, err := e.GradReady(1, Halfs(good, BF16), s); err != nil {
			t.Fatal(err)
		}
		if _, err := e.GradReady(1, Halfs(good, BF16), s); !errors.Is(err, ErrDuplicateGrad) {
			t.Errorf("stage %d twice: %v, want ErrDuplicateGrad", stage, err)
		}
		if err := e.Step(); !errors.Is(err, ErrProtocol) {
			t.Errorf("stage %d: Step inside a backward: %v, want ErrProtocol", stage, err)
		}
		if err := e.EndBackward(); err != nil {
			t.Fatal(err)
		}
		if err := e.Step(); err != nil {
			t.Fatal(err)
		}
		full, err := e.FullGrads()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(full[1], []float32{1, 2, 3}) || !slices.Equal(full[0], make([]float32, 8)) {
			t.Errorf("stage %d: after refused calls the gradient is %v %v, want [1 2 3] and zeros", stage, full[1], full[0])
		}
		e.Close()
		s.Close()
		if _, err := e.GradReady(1, Halfs(good, BF16), s); !errors.Is(err, ErrClosed) {
			t.Errorf("after Close: %v, want ErrClosed", err)
		}
	}
}

// errWrappingComm fails its first reduce-scatter with an error of its own
// that wraps ErrCollective, as a caller's Comm may report a failed
// collective.
type errWrappingComm struct {
	Comm
	fired bool
}

func (c *errWrappingComm) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	if !c.fired {
		c.fired = true
		return fmt.Errorf("%w: the caller's comm lost a peer", ErrCollective)
	}
	return c.Comm.ReduceScatter(s, send, recv, op)
}

// TestCommErrorWrappingErrCollectiveFailsTheEngine: a Comm's error that
// wraps ErrCollective is a cause like any other: the engine fails on it and
// refuses every later call (it once took such an error for its own failure
// and went on; the fuzzer found it).
func TestCommErrorWrappingErrCollectiveFailsTheEngine(t *testing.T) {
	comms, _ := NewLocalGroup(1)
	e, err := New(Config{Stage: 1, BucketBytes: 1 << 20}, &errWrappingComm{Comm: comms[0]}, []Param{{Name: "w", Count: 64, DType: FP32}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	s := NewHostStream()
	defer s.Close()
	e.SetBoundary(true) // the local bucket is reduced in the backward, on GradReady
	g := make([]float32, 64)
	_, err = e.GradReady(0, Float32s(g), s)
	if err == nil {
		err = e.EndBackward()
	}
	if !errors.Is(err, ErrCollective) {
		t.Fatalf("the failed reduce-scatter: %v, want ErrCollective", err)
	}
	for op, call := range map[string]func() error{"EndBackward": e.EndBackward, "Step": e.Step} {
		if err := call(); !errors.Is(err, ErrCollective) || !strings.Contains(err.Error(), "failed earlier") {
			t.Errorf("%s after the failure: %v, want the engine's earlier failure", op, err)
		}
	}
}
