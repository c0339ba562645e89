package zero

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// FuzzProtocol drives random call sequences on 2-4 in-process ranks. An
// input decodes (fzDecode) into a config and ONE program shared by every
// rank; ranks differ only in their data, the order and batching of their
// gradients, the producer streams they use, and (sparse) gradients they
// leave out. In a few percent of inputs one rank diverges: it skips a
// backward, a collective fails on it (returned, on its stream, or as an
// aborted communicator), or it closes its engine (and leaves the group).
//
// Checks: no panic, no hang (a 2 s collective timeout, and every rank
// closes its engine and communicator when its program ends); in step, every
// rank has the same outcome for every call (a refusal is the same refusal
// everywhere, ErrDuplicateGrad exactly where the batch repeats a gradient of
// the backward) and no collective error at all; every rank's outcomes follow
// the protocol's rules (fzModel: ErrProtocol exactly where a call is out of
// order, ErrClosed after Close); Close frees every device byte; after a
// divergence, the
// next Step fails on every rank (on the failing rank for an error on its
// stream); and every successful Step, and every read after it, against a
// float64 reference: the shard and the full gradient are the mean
// (1/(W·G)) Σ_ranks Σ_backwards grad (a gradient a rank did not hand over
// counts as zero), SGD's parameters are p − lr·mean/S/max(1, norm/clip),
// AdamW's are finite and the same bits on every rank, a step with an inf
// gradient is skipped on every rank, and stage 3's gathered parameters are
// the same bits on every rank and those the last step left.
//
// Run it (the machine's cores; ZERO_FUZZ_STATS appends one JSON line per
// execution, summarised by TestFuzzStatsSummary):
//
//	ZERO_FUZZ_STATS=/tmp/fuzz.jsonl go test -run '^$' -fuzz FuzzProtocol -fuzztime 5m .
//	ZERO_FUZZ_STATS=/tmp/fuzz.jsonl go test -count=1 -run TestFuzzStatsSummary -v .
//
// A failure logs the decoded config and program, and each rank's outcome of
// every call; go test -run 'FuzzProtocol/<file>' replays a corpus file.
// Go's fuzzing does not report a failure it meets while minimizing an
// interesting input (it takes it for a flake); the stats line records it,
// and TestFuzzStatsSummary fails with its input. The generator keeps the
// rules whose breach no rank can detect by itself: SetBoundary between
// backwards only, and at stage 3 the same parameters on every rank in a
// backward that gathers. The named seeds in
// testdata/fuzz/FuzzProtocol are written by
// ZERO_FUZZ_WRITE_CORPUS=1 go test -run TestFuzzWriteCorpus .
func FuzzProtocol(f *testing.F) {
	for _, s := range fzSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c := fzDecode(data)
		start := time.Now()
		logs, hang := c.run()
		st := c.newStats()
		st.Millis = float64(time.Since(start).Microseconds()) / 1000
		var problems []string
		if hang != "" {
			problems = []string{hang}
			st.Hang = true
		} else {
			problems = c.check(logs, st)
		}
		st.Failed = len(problems) > 0
		if st.Failed {
			st.Problem, st.Input = problems[0], fmt.Sprintf("%x", data)
		}
		fzWriteStats(st)
		if len(problems) > 0 {
			var b strings.Builder
			fmt.Fprintf(&b, "%s\n", c)
			if logs != nil {
				b.WriteString(c.outcomeTable(logs))
			}
			for _, p := range problems {
				fmt.Fprintf(&b, "FAIL: %s\n", p)
			}
			t.Fatal(b.String())
		}
	})
}

// ---- the input --------------------------------------------------------------

const (
	fzHeadLen = 20               // config bytes before the program
	fzMaxOps  = 64               // calls per program, macros expanded
	fzTimeout = 2 * time.Second  // the group's: a peer that never comes
	fzHang    = 60 * time.Second // the whole execution
)

// Tables the config bytes index; entry 0 is the common case, as a byte
// past the end of a short input reads 0.
var (
	fzBuckets = [...]int{256, 64, 128, 512, 1024, 1 << 20}
	fzSizes   = [...]int{64, 7, 300, 1, 129, 0, 31, 200, 16, 100, 3, 257}
	fzBudgets = [...]int{0, 256, 1024, 4096}
	fzAccums  = [...]int{0, 0, 0, 0, 0, 1, 2, 3}
	fzOpts    = [...]string{"none", "none", "sgd", "adamw"}
	fzLRs     = [...]float64{0.1, 0.05, 0.5, 0.01}
	fzClips   = [...]float64{0, 0, 0.5, 3}
	fzAligns  = [...]int{0, 1, 4, 16}
	// the divergence byte: values from fzDivFrom on pick one (5%)
	fzDivs = [...]string{"skip", "skip", "skip", "fault-return", "fault-return", "fault-stream", "fault-stream",
		"fault-abort", "close", "close", "leave", "skip", "fault-return"}
)

const fzDivFrom = 256 - len(fzDivs)

func fzLossScale(dt DType, k int) LossScale {
	if dt == FP16 {
		return [...]LossScale{{Initial: 1}, {Static: 1}, {Initial: 16}, {Static: 8}}[k]
	}
	return [...]LossScale{{}, {}, {Static: 4}, {}}[k]
}

// Op codes: the first byte of each operation picks one by range.
const (
	fzCodeBackward      = 0   // [0, 70): a backward, 2 argument bytes (fzCase.backward)
	fzCodeStep          = 70  // [70, 120): Step
	fzCodeCoalesce      = 120 // [120, 135): BeginCoalesce, 1-3 backwards, EndCoalesce
	fzCodeNoSync        = 135 // [135, 145): BeginNoSync, 1-2 backwards, EndNoSync, the backward after
	fzCodeRead          = 145 // [145, 160): GradShard, FullGrads or GradView(p).Read
	fzCodeGrads         = 160 // [160, 180): one GradsReady batch of 1-3 parameters, as written
	fzCodeEnd           = 180 // [180, 188): EndBackward
	fzCodeBoundary      = 188 // [188, 192): SetBoundary
	fzCodeBeginCoalesce = 192
	fzCodeEndCoalesce   = 196
	fzCodeBeginNoSync   = 200
	fzCodeEndNoSync     = 204
	fzCodeGather        = 208 // [208, 222): Gather of 1-3 parameters
	fzCodeRelease       = 222 // [222, 236): Release of 1-3 parameters
	fzCodeForward       = 236 // [236, 240): Gather every parameter, then Release them
	fzCodeClose         = 240 // [240, 244): Close on every rank
	fzCodePoison        = 244 // [244, 252): a batch with an inf on one rank
	fzCodeStep2         = 252 // [252, 256): Step
)

type fzKind uint8

const (
	fzBackward fzKind = iota // a backward's gradients: order, batches and streams per rank
	fzGrads                  // one GradsReady batch as written (duplicates possible)
	fzEnd
	fzBoundary
	fzStep
	fzBeginCoalesce
	fzEndCoalesce
	fzBeginNoSync
	fzEndNoSync
	fzGather
	fzRelease
	fzShard
	fzFull
	fzView
	fzClose
)

var fzKindNames = [...]string{"backward", "grads", "end", "boundary", "step", "beginCoalesce", "endCoalesce",
	"beginNoSync", "endNoSync", "gather", "release", "shard", "full", "view", "close"}

func (k fzKind) String() string { return fzKindNames[k] }

// sensitive calls depend on whether a backward is under way: a rank that
// left out a batch must not meet one before the backward ends.
func (k fzKind) sensitive() bool {
	switch k {
	case fzStep, fzBeginCoalesce, fzEndCoalesce, fzBeginNoSync, fzEndNoSync, fzShard, fzFull, fzView:
		return true
	}
	return false
}

type fzOp struct {
	kind    fzKind
	params  []int // backward, grads, gather, release: the parameters; view: params[0]
	shuffle bool  // backward: each rank reports in an order of its own
	batch   uint8 // backward: 0 one GradReady each, 1 batches each rank draws, 2 one GradsReady
	silent  int   // backward, grads: this rank reports nothing (−1: none)
	poison  int   // backward, grads: this rank's first nonempty gradient has an inf (−1: none)
	on      bool  // boundary
	omit    bool  // backward, grads: a rank may leave gradients out (see markOmittable)
}

func (o fzOp) String() string {
	s := o.kind.String()
	switch o.kind {
	case fzBackward:
		s += fmt.Sprintf("%v", o.params)
		if o.shuffle {
			s += " shuffled"
		}
		s += [...]string{" singles", " batches", " one-batch"}[o.batch]
		if o.silent >= 0 {
			s += fmt.Sprintf(" silent=r%d", o.silent)
		}
	case fzGrads, fzGather, fzRelease, fzView:
		s += fmt.Sprintf("%v", o.params)
		if o.kind == fzGrads && o.silent >= 0 {
			s += fmt.Sprintf(" silent=r%d", o.silent)
		}
	case fzBoundary:
		s += fmt.Sprintf("(%v)", o.on)
	}
	if o.poison >= 0 && (o.kind == fzBackward || o.kind == fzGrads) {
		s += fmt.Sprintf(" inf@r%d", o.poison)
	}
	return s
}

type fzDiv struct {
	kind   string // "", skip, fault-return, fault-stream, fault-abort, close, leave
	rank   int
	target int // faults: the n-th collective after New (from 1); close, leave: the op
	at     int // skip: the first op left out; close, leave: the op
	end    int // skip: the EndBackward left out
}

func (d fzDiv) fault() bool { return strings.HasPrefix(d.kind, "fault") }

// fzCase is a decoded input.
type fzCase struct {
	world, stage int
	dtype        DType
	cfg          Config
	sizes        []int
	memory       bool   // parameters registered with Data
	opt          string // none, sgd, adamw
	lr           float64
	streams      int
	sparse       bool // ranks leave out some gradients
	seed         uint64
	ops          []fzOp
	div          fzDiv
	skip         []bool // skip: the ops the diverging rank leaves out
	open         bool   // decoding: a backward has begun (gradients since the last EndBackward)
}

type fzBytes struct {
	b []byte
	i int
}

func (r *fzBytes) next() byte {
	if r.i >= len(r.b) {
		return 0
	}
	r.i++
	return r.b[r.i-1]
}

func (r *fzBytes) left() bool { return r.i < len(r.b) }

func fzDecode(data []byte) *fzCase {
	r := &fzBytes{b: data}
	c := &fzCase{}
	c.world = 2 + int(r.next())%3
	c.stage = 1 + int(r.next())%3
	c.dtype = [...]DType{FP32, BF16, FP16}[r.next()%3]
	c.cfg = Config{Stage: c.stage, BucketBytes: fzBuckets[int(r.next())%len(fzBuckets)]}
	flags := r.next()
	c.cfg.Overlap = flags&1 != 0
	if flags&2 != 0 {
		c.cfg.Window.DType = c.dtype
	}
	c.cfg.Offload.Optimizer = flags&12 == 12
	c.cfg.Offload.Params = c.stage == 3 && flags&128 != 0
	c.cfg.Window.BudgetBytes = fzBudgets[flags>>4&3]
	c.sparse = flags&64 != 0
	c.cfg.Grads.AccumSteps = fzAccums[r.next()%8]
	c.opt = fzOpts[r.next()%4]
	h, s := r.next(), r.next()
	c.streams = 1 + int(s)%3
	c.cfg.Align = fzAligns[s>>2&3]
	np := 1 + int(r.next())%5
	for i := range 5 {
		n := fzSizes[int(r.next())%len(fzSizes)]
		if i < np {
			c.sizes = append(c.sizes, n)
		}
	}
	c.seed = uint64(r.next()) | uint64(r.next())<<8
	d, dr, dt := r.next(), r.next(), r.next()
	c.memory = c.opt != "none" || (c.stage == 3 && flags&128 != 0)
	c.lr = fzLRs[h&3]
	switch c.opt {
	case "sgd":
		c.cfg.Optimizer.Groups = []Optimizer{NewSGD(c.lr)}
	case "adamw":
		c.cfg.Optimizer.Groups = []Optimizer{with(NewAdamW(c.lr), func(o *AdamW) { o.WeightDecay = 0.01 })}
	}
	if c.opt != "none" {
		c.cfg.Optimizer.Clip = fzClips[h>>2&3]
		c.cfg.Precision.LossScale = fzLossScale(c.dtype, int(h>>4&3))
	}
	for r.left() && len(c.ops) < fzMaxOps {
		c.decodeOp(r)
	}
	if int(d) >= fzDivFrom {
		c.setDivergence(fzDivs[int(d)-fzDivFrom], int(dr)%c.world, int(dt))
	}
	c.markOmittable()
	return c
}

func (c *fzCase) add(op fzOp) {
	switch op.kind {
	case fzGrads, fzBackward:
		c.open = true
	case fzEnd:
		c.open = false
	case fzBoundary:
		// SetBoundary's rule: between backwards only. Inside one it has
		// no effect on ranks whose backward began, and ranks that handed
		// nothing over yet would flush alone.
		if op.on && c.open {
			return
		}
	}
	if len(c.ops) < fzMaxOps {
		if op.kind != fzBackward && op.kind != fzGrads {
			op.poison = -1
		}
		c.ops = append(c.ops, op)
	}
}

func (c *fzCase) decodeOp(r *fzBytes) {
	b := r.next()
	np := len(c.sizes)
	some := func() []int {
		ps := make([]int, 1+int(r.next())%3)
		for i := range ps {
			ps[i] = int(r.next()) % np
		}
		return ps
	}
	all := func() []int {
		ps := make([]int, np)
		for i := range ps {
			ps[i] = np - 1 - i
		}
		return ps
	}
	switch {
	case b >= fzCodeStep2:
		c.add(fzOp{kind: fzStep})
	case b < fzCodeStep:
		c.backward(r.next(), r.next())
	case b < fzCodeCoalesce:
		c.add(fzOp{kind: fzStep})
	case b < fzCodeNoSync:
		n := 1 + int(r.next())%3
		c.add(fzOp{kind: fzBeginCoalesce})
		for range n {
			c.backward(r.next(), r.next())
		}
		c.add(fzOp{kind: fzEndCoalesce})
	case b < fzCodeRead:
		n := 1 + int(r.next())%2
		c.add(fzOp{kind: fzBeginNoSync})
		for range n {
			c.backward(r.next(), r.next())
		}
		c.add(fzOp{kind: fzEndNoSync})
		c.backward(r.next(), r.next())
	case b < fzCodeGrads:
		a := r.next()
		c.add(fzOp{kind: [...]fzKind{fzShard, fzFull, fzView}[a%3], params: []int{int(a/3) % np}})
	case b < fzCodeEnd:
		c.grads(fzOp{kind: fzGrads, params: some(), poison: -1, silent: -1})
	case b < fzCodeBoundary:
		c.add(fzOp{kind: fzEnd})
	case b < fzCodeBeginCoalesce:
		c.add(fzOp{kind: fzBoundary, on: r.next()&1 == 0})
	case b < fzCodeEndCoalesce:
		c.add(fzOp{kind: fzBeginCoalesce})
	case b < fzCodeBeginNoSync:
		c.add(fzOp{kind: fzEndCoalesce})
	case b < fzCodeEndNoSync:
		c.add(fzOp{kind: fzBeginNoSync})
	case b < fzCodeGather:
		c.add(fzOp{kind: fzEndNoSync})
	case b < fzCodeRelease:
		c.add(fzOp{kind: fzGather, params: some()})
	case b < fzCodeForward:
		c.add(fzOp{kind: fzRelease, params: some()})
	case b < fzCodeClose:
		c.add(fzOp{kind: fzGather, params: all()})
		c.add(fzOp{kind: fzRelease, params: all()})
	case b < fzCodePoison:
		c.add(fzOp{kind: fzClose})
	default:
		rank := int(r.next()) % c.world
		c.grads(fzOp{kind: fzGrads, params: some(), poison: rank, silent: -1})
	}
}

// grads appends a batch as written; at stage 3 with parameters, gathered
// before and released after, since GradReady refuses a parameter that no
// Gather named since the last Step (a rule every rank breaks alike, which
// TestStage3GradWithoutGather holds).
func (c *fzCase) grads(op fzOp) {
	if c.stage == 3 && c.memory {
		c.add(fzOp{kind: fzGather, params: op.params})
		c.add(op)
		c.add(fzOp{kind: fzRelease, params: op.params})
		return
	}
	c.add(op)
}

// backward appends a backward: bits of a: 0-1 the order (reverse
// registration, shuffled per rank, registration), 2-3 the batching, 4 a
// SetBoundary(true) first, 5 parameter a2%n left out on every rank, 6 rank
// (a2>>3)%W silent; a2 ≥ 248 puts an inf in rank a2%W's gradients. At
// stage 3 with parameters every parameter is gathered around its gradient
// (GradReady refuses one that no Gather named since the last Step).
func (c *fzCase) backward(a, a2 byte) {
	np := len(c.sizes)
	op := fzOp{kind: fzBackward, silent: -1, poison: -1}
	for p := np - 1; p >= 0; p-- {
		op.params = append(op.params, p)
	}
	switch a & 3 {
	case 1:
		op.shuffle = true
	case 2:
		slices.Reverse(op.params)
	}
	op.batch = [...]uint8{0, 1, 2, 0}[a>>2&3]
	if a&32 != 0 && np > 1 {
		out := int(a2) % np
		op.params = slices.DeleteFunc(op.params, func(p int) bool { return p == out })
	}
	if a&64 != 0 {
		op.silent = int(a2>>3) % c.world
	}
	if a2 >= 248 {
		op.poison = int(a2) % c.world
	}
	gathered := c.stage == 3 && c.memory
	all := make([]int, np)
	for i := range all {
		all[i] = np - 1 - i
	}
	if a&16 != 0 {
		c.add(fzOp{kind: fzBoundary, on: true})
	}
	if gathered {
		// layer by layer, as stage 3 runs a backward: each parameter
		// gathered, its gradient handed over (left out by the silent rank),
		// released
		for k, p := range op.params {
			c.add(fzOp{kind: fzGather, params: []int{p}})
			g := fzOp{kind: fzGrads, params: []int{p}, silent: op.silent, poison: -1}
			if k == 0 {
				g.poison = op.poison
			}
			c.add(g)
			c.add(fzOp{kind: fzRelease, params: []int{p}})
		}
	} else {
		c.add(op)
	}
	c.add(fzOp{kind: fzEnd})
}

func (c *fzCase) setDivergence(kind string, rank, t int) {
	switch kind {
	case "skip":
		var ends []int
		for i, op := range c.ops {
			if op.kind == fzEnd {
				ends = append(ends, i)
			}
		}
		if len(ends) == 0 {
			return
		}
		k := min(t%4, len(ends)-1)
		from := 0
		if k > 0 {
			from = ends[k-1] + 1
		}
		c.div = fzDiv{kind: kind, rank: rank, at: from, end: ends[k]}
		c.skip = make([]bool, len(c.ops))
		for i := from; i <= ends[k]; i++ {
			switch c.ops[i].kind {
			case fzBackward, fzGrads, fzEnd:
				c.skip[i] = true
			}
		}
	case "close", "leave":
		if len(c.ops) == 0 {
			return
		}
		c.div = fzDiv{kind: kind, rank: rank, at: t % len(c.ops)}
	default:
		c.div = fzDiv{kind: kind, rank: rank, target: 1 + t%24}
	}
}

// markOmittable lets a rank leave out gradients (silent, sparse) only where
// the backward ends before any call that depends on a backward being under
// way, and before Close or the end of the program: a rank that handed over
// a bucket's last gradient has issued its reduction, which the others issue
// at EndBackward. Collectives between (Gather) are not excepted: their
// order must not depend on which gradients a rank had.
func (c *fzCase) markOmittable() {
	for i := range c.ops {
		if k := c.ops[i].kind; k != fzGrads && k != fzBackward {
			continue
		}
		for _, later := range c.ops[i+1:] {
			if later.kind == fzEnd {
				c.ops[i].omit = true
				break
			}
			if later.kind.sensitive() || later.kind == fzClose {
				break
			}
			// Stage 3's rule: every rank hands over the same parameters in a
			// backward that gathers, since a bucket's reduction, issued when
			// it fills, shares the communicator with the gathers.
			if later.kind == fzGather && c.stage == 3 {
				break
			}
		}
	}
}

func (c *fzCase) paramList() []Param {
	ps := make([]Param, len(c.sizes))
	for i, n := range c.sizes {
		ps[i] = Param{Name: fmt.Sprint("p", i), Count: n, DType: c.dtype}
	}
	return ps
}

func (c *fzCase) String() string {
	var b strings.Builder
	cfg := c.cfg
	fmt.Fprintf(&b, "world %d stage %d %v sizes %v memory %v opt %s", c.world, c.stage, c.dtype, c.sizes, c.memory, c.opt)
	if c.opt != "none" {
		fmt.Fprintf(&b, " lr %g clip %g lossScale %+v", c.lr, cfg.Optimizer.Clip, cfg.Precision.LossScale)
	}
	fmt.Fprintf(&b, "\n  Config{BucketBytes: %d, Overlap: %v, Align: %d, Grads: GradPolicy{AccumSteps: %d}, Window: WindowPolicy{BudgetBytes: %d, DType: %v}, Offload: OffloadPolicy{Optimizer: %v, Params: %v}} streams %d sparse %v seed %d",
		cfg.BucketBytes, cfg.Overlap, cfg.Align, cfg.Grads.AccumSteps, cfg.Window.BudgetBytes, cfg.Window.DType, cfg.Offload.Optimizer, cfg.Offload.Params, c.streams, c.sparse, c.seed)
	if c.div.kind != "" {
		fmt.Fprintf(&b, "\n  divergence: %s on rank %d", c.div.kind, c.div.rank)
		switch {
		case c.div.fault():
			fmt.Fprintf(&b, " at its collective %d after New", c.div.target)
		case c.div.kind == "skip":
			fmt.Fprintf(&b, ": leaves out the backward of ops %d..%d", c.div.at, c.div.end)
		default:
			fmt.Fprintf(&b, " before op %d", c.div.at)
		}
	}
	for i, op := range c.ops {
		fmt.Fprintf(&b, "\n  %2d %s", i, op)
	}
	return b.String()
}

// ---- a rank's run ------------------------------------------------------------

var errFuzzFault = fmt.Errorf("%w: fuzz: injected collective failure", ErrCollective)

// fzComm fails its failAt-th collective after arm: mode return fails the
// call, stream runs it and then fails its stream (as faultyComm; the rank
// then leaves the group, see runRank), abort runs it and then reports the
// communicator aborted (as abortingComm).
type fzComm struct {
	Comm
	dev     Device // nil: the communicator's
	mode    string
	failAt  int
	calls   int
	armed   bool
	fired   bool
	failed  Stream // fault-stream: the stream it failed
	aborted atomic.Bool
}

func (c *fzComm) hit(s Stream, run func() error) error {
	if !c.armed || c.failAt == 0 || c.fired {
		return run()
	}
	if c.calls++; c.calls < c.failAt {
		return run()
	}
	c.fired = true
	switch c.mode {
	case "fault-return":
		return errFuzzFault
	case "fault-stream":
		if err := run(); err != nil {
			return err
		}
		c.failed = s
		return s.(*HostStream).Launch(func() error { return errFuzzFault })
	}
	err := run()
	c.aborted.Store(true)
	return err
}

func (c *fzComm) AllReduce(s Stream, buf Tensor, op ReduceOp) error {
	return c.hit(s, func() error { return c.Comm.AllReduce(s, buf, op) })
}

func (c *fzComm) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	return c.hit(s, func() error { return c.Comm.ReduceScatter(s, send, recv, op) })
}

func (c *fzComm) AllGather(s Stream, send, recv Tensor) error {
	return c.hit(s, func() error { return c.Comm.AllGather(s, send, recv) })
}

func (c *fzComm) Broadcast(s Stream, buf Tensor, root int) error {
	return c.hit(s, func() error { return c.Comm.Broadcast(s, buf, root) })
}

func (c *fzComm) Device() Device {
	if c.dev != nil {
		return c.dev
	}
	return c.Comm.Device()
}

func (c *fzComm) asyncErr() error {
	if c.aborted.Load() {
		return errFuzzFault
	}
	return nil
}

// fzOut is one rank's outcome of one op.
type fzOut struct {
	ran   bool // false: left out by this rank
	class string
	err   error
	dups  int // batches refused as duplicates
}

// fzWindow is what a rank handed over since its last Step, in float64.
type fzWindow struct {
	g         int
	sum, mag  [][]float64
	poison    []bool
	anyPoison bool
}

func newFzWindow(sizes []int) *fzWindow {
	w := &fzWindow{sum: make([][]float64, len(sizes)), mag: make([][]float64, len(sizes)), poison: make([]bool, len(sizes))}
	for p, n := range sizes {
		w.sum[p], w.mag[p] = make([]float64, n), make([]float64, n)
	}
	return w
}

func (w *fzWindow) clone() *fzWindow {
	c := &fzWindow{g: w.g, poison: slices.Clone(w.poison), anyPoison: w.anyPoison}
	for p := range w.sum {
		c.sum = append(c.sum, slices.Clone(w.sum[p]))
		c.mag = append(c.mag, slices.Clone(w.mag[p]))
	}
	return c
}

type fzGradRec struct {
	p   int
	ref []float64
}

// fzStepRec is what a rank saw after a successful Step.
type fzStepRec struct {
	scale    float64 // LossScale before the Step
	stats    Stats
	shard    []float32 // GradShard right after
	shardErr error
	params   [][]uint32 // stages 1-2: every parameter's memory; stage 3: this rank's ranges, from ParamOffset of its range
}

type fzRead struct {
	op, step int // the op, and the op of the Step it reads
	kind     fzKind
	param    int
	shard    []float32
	full     [][]float32
	view     []float32
	rg       ShardRange
}

type fzLog struct {
	out      []fzOut
	newErr   error
	plan     *Plan
	initial  [][]uint32 // this rank's parameter memory before New
	afterNew [][]uint32 // after New (rank 0's, broadcast)
	wins     map[int]*fzWindow
	steps    map[int]*fzStepRec
	reads    []fzRead
	gathers  map[int][][]uint32 // nil: reading the views on their stream failed
	faultOp  int                // the op during which the injected fault fired (−1)
	closeErr error
	closed   bool // the program closed the engine
	problems []string
	timeouts int
	leaked   int // device bytes still allocated after Close (without Offload)
}

func (lg *fzLog) problem(format string, args ...any) {
	lg.problems = append(lg.problems, fmt.Sprintf(format, args...))
}

type fzRank struct {
	c        *fzCase
	rank     int
	e        *Engine
	comm     *fzComm
	streams  []*HostStream
	data     []*tbuf
	rng      *rand.Rand
	lg       *fzLog
	accepted []bool
	bwd      []fzGradRec
	win      *fzWindow
	lastStep int
	keep     []*tbuf // every gradient handed over stays alive to the end
	diverged bool    // this rank left the program shared by all (or broke)
	m        *fzModel
	progress atomic.Int64 // ops done
	// anyAccepted: the last backward or grads op had a batch taken
	anyAccepted bool
	views       []fzViews       // gathered views being read
	users       [][]*HostStream // per parameter: the streams its views were used on
}

// run runs every rank and returns their logs, or a description of a hang.
func (c *fzCase) run() ([]*fzLog, string) {
	comms, err := NewLocalGroupTimeout(c.world, fzTimeout)
	if err != nil {
		return nil, err.Error()
	}
	logs := make([]*fzLog, c.world)
	sh := &fzShared{}
	sh.drained.Add(c.world)
	done := make(chan struct{})
	go func() {
		eachRank(c.world, func(rank int) error {
			logs[rank] = c.runRank(rank, comms[rank], sh)
			return nil
		})
		close(done)
	}()
	select {
	case <-done:
		return logs, ""
	case <-time.After(fzHang):
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		return nil, fmt.Sprintf("hang: the ranks did not finish within %v\n%s", fzHang, buf)
	}
}

// fzShared is what the ranks of one execution share: the barrier they pass
// before freeing any memory.
type fzShared struct {
	drained sync.WaitGroup
}

func (c *fzCase) runRank(rank int, comm Comm, sh *fzShared) (lg *fzLog) {
	lg = &fzLog{out: make([]fzOut, len(c.ops)), wins: map[int]*fzWindow{}, steps: map[int]*fzStepRec{}, gathers: map[int][][]uint32{}, faultOp: -1}
	fc := &fzComm{Comm: comm}
	if !c.cfg.Offload.Optimizer {
		// Freed memory stays mapped until the end (see finish); the ledger
		// checks that Close frees every byte. Offload needs the host device.
		fc.dev = newCountingDevice()
	}
	if c.div.fault() && c.div.rank == rank {
		fc.mode, fc.failAt = c.div.kind, c.div.target
	}
	rr := &fzRank{c: c, rank: rank, comm: fc, lg: lg, accepted: make([]bool, len(c.sizes)), win: newFzWindow(c.sizes), lastStep: -1,
		rng: rand.New(rand.NewPCG(c.seed, uint64(rank)+1))}
	rr.diverged = c.div.kind == "skip" && c.div.rank == rank
	rr.m = newFzModel(c)
	rr.users = make([][]*HostStream, len(c.sizes))
	defer func() {
		if p := recover(); p != nil {
			lg.problem("rank %d panicked: %v\n%s", rank, p, debug.Stack())
			rr.diverged = true
		}
		rr.finish(sh)
	}()
	for range c.streams {
		rr.streams = append(rr.streams, NewHostStream())
	}
	params := c.paramList()
	if c.memory {
		for p, n := range c.sizes {
			b := newTBuf(c.dtype, n)
			ini := rand.New(rand.NewPCG(c.seed^0x5eed, uint64(rank*64+p)))
			for i := range n {
				b.set(i, float32(ini.Float64()*2-1))
			}
			rr.data = append(rr.data, b)
			params[p].Data = b.t()
			lg.initial = append(lg.initial, rr.bits(b))
		}
	}
	e, err := New(c.cfg, fc, params)
	if err != nil {
		lg.newErr = err
		rr.diverged = true
		return lg
	}
	rr.e = e
	lg.plan = e.Plan()
	for _, b := range rr.data {
		lg.afterNew = append(lg.afterNew, rr.bits(b))
	}
	fc.armed = true
	for i, op := range c.ops {
		if (c.div.kind == "close" || c.div.kind == "leave") && c.div.rank == rank && i == c.div.at {
			rr.diverged = true
			if c.div.kind == "leave" {
				comm.Close() // its engine is closed at the end (see finish)
			} else {
				e.Close()
				rr.m.closed = true
			}
		}
		if c.skip != nil && c.div.rank == rank && c.skip[i] {
			continue
		}
		fired := fc.fired
		want := rr.m.predict(op)
		lg.out[i] = rr.exec(i, op)
		lg.out[i].ran = true
		rr.progress.Add(1)
		if lg.out[i].class == "ErrTimeout" {
			lg.timeouts++
		}
		rr.m.check(rr, i, op, want, lg.out[i])
		if !fired && fc.fired {
			lg.faultOp = i
			rr.diverged = true
			if fc.failed != nil {
				// Peers wait on the collectives its failed stream skips;
				// it may wait on theirs: leave the group once it stalls
				// (as NCCL's watchdog aborts), not at once, so that its
				// next Step still meets a healthy group.
				stop := make(chan struct{})
				defer close(stop)
				go rr.leaveWhenStalled(comm, stop)
			}
		}
	}
	return lg
}

// leaveWhenStalled closes comm once the rank has made no progress for
// 300 ms, or returns at stop.
func (rr *fzRank) leaveWhenStalled(comm Comm, stop chan struct{}) {
	last, since := rr.progress.Load(), time.Now()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			if n := rr.progress.Load(); n != last {
				last, since = n, time.Now()
			} else if time.Since(since) > 300*time.Millisecond {
				comm.Close()
				return
			}
		}
	}
}

// fzModel is the protocol's rules, per rank: which calls must be refused
// with ErrProtocol (or ErrClosed), from what this rank did. It stops at the
// first collective failure on the rank.
type fzModel struct {
	off                       bool
	closed                    bool
	inBackward, stepped       bool
	backwards                 int
	active, noSync, flushNext bool
	refs                      []int // stage 3 with parameter memory
	sharded                   bool  // stage 3 with parameter memory
	sizes                     []int
	accum                     int
}

func newFzModel(c *fzCase) *fzModel {
	m := &fzModel{refs: make([]int, len(c.sizes)), sizes: c.sizes, accum: c.cfg.Grads.AccumSteps}
	m.sharded = c.stage == 3 && c.memory && slices.ContainsFunc(c.sizes, func(n int) bool { return n > 0 })
	return m
}

// predict is the class op must have ("" where the model has no opinion).
func (m *fzModel) predict(op fzOp) string {
	if m.off {
		return ""
	}
	if m.closed {
		switch op.kind {
		case fzBoundary:
			return "ok"
		case fzClose:
			return "ok" // closing twice does nothing
		case fzBackward, fzGrads:
			return "ErrClosed" // of every call it makes
		}
		return "ErrClosed"
	}
	refused := false
	switch op.kind {
	case fzBackward, fzGrads, fzBoundary, fzClose:
		return ""
	case fzEnd:
		return "ok"
	case fzStep:
		gathered := false
		for _, r := range m.refs {
			gathered = gathered || r > 0
		}
		refused = m.inBackward || m.active || m.noSync || gathered || m.backwards == 0 || (m.accum > 0 && m.backwards != m.accum)
	case fzBeginCoalesce, fzBeginNoSync:
		refused = m.inBackward || m.active || m.noSync || m.flushNext
	case fzEndCoalesce:
		refused = !m.active || m.inBackward
	case fzEndNoSync:
		refused = !m.noSync || m.inBackward
	case fzShard, fzFull, fzView:
		refused = m.inBackward || m.backwards > 0 || !m.stepped
	case fzGather:
		refused = !m.sharded
	case fzRelease:
		refused = !m.sharded
		for i, p := range op.params {
			if want := 1 + fzCount(op.params[:i], p); !refused && m.sizes[p] > 0 && m.refs[p] < want {
				refused = true
			}
		}
	}
	if refused {
		return "ErrProtocol"
	}
	return "ok"
}

func fzCount(ps []int, p int) int {
	n := 0
	for _, q := range ps {
		if q == p {
			n++
		}
	}
	return n
}

// check compares op's outcome with the prediction, and moves the model on.
func (m *fzModel) check(rr *fzRank, i int, op fzOp, want string, got fzOut) {
	if m.off {
		return
	}
	if errors.Is(got.err, ErrCollective) { // a fatal failure, whatever its cause
		m.off = true
		return
	}
	switch got.class {
	case "ok", "ErrProtocol", "ErrClosed", "ErrDuplicateGrad", "omitted":
	default:
		m.off = true // a collective failed: the engine refuses everything now
		return
	}
	if want != "" && got.class != want && !(got.class == "omitted" && (op.kind == fzBackward || op.kind == fzGrads)) {
		rr.lg.problem("rank %d op %d (%s): %s (%v), the protocol's rules say %s", rr.rank, i, op, got.class, got.err, want)
		m.off = true
		return
	}
	if got.class != "ok" {
		return
	}
	switch op.kind {
	case fzBackward, fzGrads:
		if rr.anyAccepted {
			m.inBackward = true
		}
	case fzEnd:
		m.inBackward, m.flushNext = false, false
		m.backwards++
	case fzStep:
		m.backwards, m.stepped, m.flushNext = 0, true, false
	case fzBeginCoalesce:
		m.active = true
	case fzEndCoalesce:
		m.active = false
	case fzBeginNoSync:
		m.noSync = true
	case fzEndNoSync:
		m.noSync, m.flushNext = false, true
	case fzGather:
		for _, p := range op.params {
			if m.sizes[p] > 0 {
				m.refs[p]++
			}
		}
	case fzRelease:
		for _, p := range op.params {
			if m.sizes[p] > 0 {
				m.refs[p]--
			}
		}
	case fzClose:
		m.closed = true
	}
}

// finish closes the engine and the communicator: a rank that left the
// shared program its communicator first, so that peers waiting in a
// collective it will not issue fail at once. No rank frees memory before
// every rank's streams are idle, and (without Offload) freed memory stays
// mapped until then: a peer's collective may still read this rank's
// buffers after the group was aborted (a known bug, not fixed here: an
// aborted in-process group lets a rank leave a collective, and start one
// whose peers have arrived, while the others' part of it still runs).
func (rr *fzRank) finish(sh *fzShared) {
	if rr.diverged {
		rr.comm.Close()
	}
	rr.collectViews()
	if rr.e != nil {
		rr.e.drain()
	}
	for _, s := range rr.streams {
		s.Sync()
	}
	sh.drained.Done()
	sh.drained.Wait()
	if rr.e != nil {
		err := rr.e.Close()
		if !rr.lg.closed {
			rr.lg.closeErr = err
		}
	}
	for _, s := range rr.streams {
		s.Close()
	}
	rr.comm.Close()
	if d, ok := rr.comm.dev.(*countingDevice); ok {
		rr.lg.leaked = d.liveBytes()
		d.release()
	}
}

func (rr *fzRank) bits(b *tbuf) []uint32 {
	out := make([]uint32, b.len())
	for i := range out {
		out[i] = b.bits(i)
	}
	return out
}

func (rr *fzRank) stream() *HostStream { return rr.streams[rr.rng.IntN(len(rr.streams))] }

// grad is this rank's gradient of parameter p in op, and its values.
func (rr *fzRank) grad(op, p int, poison bool) (*tbuf, []float64) {
	n := rr.c.sizes[p]
	g := newTBuf(rr.c.dtype, n)
	rng := rand.New(rand.NewPCG(rr.c.seed^(uint64(rr.rank)+1)*0x9e3779b97f4a7c15, uint64(op)<<8|uint64(p)))
	scale := [...]float64{1, 0.5, 2, 0.25}[rng.IntN(4)]
	ref := make([]float64, n)
	for i := range n {
		g.set(i, float32(rng.NormFloat64()*scale))
		ref[i] = float64(g.val(i))
	}
	if poison && n > 0 {
		g.set(0, float32(math.Inf(1)))
		ref[0] = math.Inf(1)
	}
	rr.keep = append(rr.keep, g)
	return g, ref
}

var fzSentinels = []struct {
	name string
	err  error
}{
	{"ErrDuplicateGrad", ErrDuplicateGrad}, {"ErrProtocol", ErrProtocol}, {"ErrCollectiveMismatch", ErrCollectiveMismatch},
	{"ErrPeerFailed", ErrPeerFailed}, {"ErrTimeout", ErrTimeout}, {"ErrClosed", ErrClosed},
	{"ErrCollective", ErrCollective}, {"ErrConfig", ErrConfig}, {"ErrParam", ErrParam}, {"ErrDType", ErrDType},
	{"ErrGradSize", ErrGradSize}, {"ErrPlanMismatch", ErrPlanMismatch}, {"ErrStream", ErrStream},
}

func fzClass(err error) string {
	if err == nil {
		return "ok"
	}
	if errors.Is(err, errFuzzFault) {
		return "injected"
	}
	for _, s := range fzSentinels {
		if errors.Is(err, s.err) {
			return s.name
		}
	}
	return "other"
}

// submit hands over one batch and checks the duplicate rule: refused with
// ErrDuplicateGrad exactly where the batch repeats a parameter, or one
// this rank reported in the backward already.
func (rr *fzRank) submit(i int, batch []int, poison bool) (string, error, bool) {
	dup := false
	seen := make([]bool, len(rr.c.sizes))
	for _, p := range batch {
		dup = dup || seen[p] || rr.accepted[p]
		seen[p] = true
	}
	grads := make([]Tensor, len(batch))
	refs := make([][]float64, len(batch))
	for j, p := range batch {
		bad := poison && rr.c.sizes[p] > 0
		g, ref := rr.grad(i, p, bad)
		poison = poison && !bad
		grads[j], refs[j] = g.t(), ref
	}
	s := rr.stream()
	var err error
	if len(batch) == 1 && rr.rng.IntN(2) == 0 {
		_, err = rr.e.GradReady(batch[0], grads[0], s)
	} else {
		_, err = rr.e.GradsReady(batch, grads, s)
	}
	class := fzClass(err)
	// a fatal error (the engine failed: a peer left, collectives diverged)
	// wraps ErrCollective beside its cause, whichever a rank saw first
	fatal := errors.Is(err, ErrCollective) || errors.Is(err, ErrClosed)
	if !fatal && class != "injected" && dup != (class == "ErrDuplicateGrad") {
		rr.lg.problem("rank %d op %d: batch %v: %v; expected a duplicate refusal: %v", rr.rank, i, batch, err, dup)
	}
	if err == nil {
		rr.anyAccepted = true
		for j, p := range batch {
			rr.accepted[p] = true
			rr.bwd = append(rr.bwd, fzGradRec{p, refs[j]})
		}
	}
	return class, err, class == "ErrDuplicateGrad"
}

func (rr *fzRank) exec(i int, op fzOp) fzOut {
	e := rr.e
	var err error
	rr.anyAccepted = false
	switch op.kind {
	case fzBackward:
		ps := slices.Clone(op.params)
		if op.silent == rr.rank && op.omit {
			ps = nil
		}
		if rr.c.sparse && op.omit {
			ps = slices.DeleteFunc(ps, func(int) bool { return rr.rng.IntN(6) == 0 })
		}
		if op.shuffle {
			rr.rng.Shuffle(len(ps), func(a, b int) { ps[a], ps[b] = ps[b], ps[a] })
		}
		out := fzOut{class: "ok"}
		if len(ps) == 0 {
			out.class = "omitted" // no call: nothing to compare
		}
		for len(ps) > 0 {
			n := 1
			switch op.batch {
			case 1:
				n = 1 + rr.rng.IntN(min(3, len(ps)))
			case 2:
				n = len(ps)
			}
			class, err, dup := rr.submit(i, ps[:n], op.poison == rr.rank)
			if dup {
				out.dups++
			} else if class != "ok" && out.class == "ok" {
				out.class, out.err = class, err
			}
			ps = ps[n:]
		}
		return out
	case fzGrads:
		if op.omit && (op.silent == rr.rank || rr.c.sparse && rr.rng.IntN(6) == 0) {
			return fzOut{class: "omitted"}
		}
		batch := slices.Clone(op.params)
		rr.rng.Shuffle(len(batch), func(a, b int) { batch[a], batch[b] = batch[b], batch[a] })
		class, err, dup := rr.submit(i, batch, op.poison == rr.rank)
		if dup {
			return fzOut{class: "ok", dups: 1}
		}
		return fzOut{class: class, err: err}
	case fzEnd:
		if err = e.EndBackward(); err == nil {
			w := rr.win
			w.g++
			for _, g := range rr.bwd {
				for k, v := range g.ref {
					w.sum[g.p][k] += v
					w.mag[g.p][k] += math.Abs(v)
					if math.IsInf(v, 0) || math.IsNaN(v) {
						w.poison[g.p], w.anyPoison = true, true
					}
				}
			}
			rr.bwd = rr.bwd[:0]
			clear(rr.accepted)
		}
	case fzBoundary:
		e.SetBoundary(op.on)
	case fzStep:
		scale := e.LossScale()
		err = e.Step()
		rr.lg.wins[i] = rr.win.clone()
		if err == nil {
			rr.recordStep(i, scale)
		}
	case fzBeginCoalesce:
		err = e.BeginCoalesce()
	case fzEndCoalesce:
		err = e.EndCoalesce()
	case fzBeginNoSync:
		err = e.BeginNoSync()
	case fzEndNoSync:
		err = e.EndNoSync()
	case fzGather:
		s := rr.stream()
		var views []Tensor
		if views, err = e.Gather(s, op.params...); err == nil {
			rr.readViews(i, s, views)
			for _, p := range op.params {
				if !slices.Contains(rr.users[p], s) {
					rr.users[p] = append(rr.users[p], s)
				}
			}
		}
	case fzRelease:
		// Release on a stream of its own, after the work of every stream
		// that used the views (as a framework joins them): Release's
		// contract is the work enqueued on its stream.
		s := rr.stream()
		for _, p := range op.params {
			for _, u := range rr.users[p] {
				if u != s {
					if ev, err := u.Record(); err == nil {
						s.Wait(ev)
					}
				}
			}
		}
		err = e.Release(s, op.params...)
	case fzShard:
		var shard []float32
		if shard, err = e.GradShard(); err == nil {
			rr.lg.reads = append(rr.lg.reads, fzRead{op: i, step: rr.lastStep, kind: fzShard, shard: shard})
		}
	case fzFull:
		var full [][]float32
		if full, err = e.FullGrads(); err == nil {
			rr.lg.reads = append(rr.lg.reads, fzRead{op: i, step: rr.lastStep, kind: fzFull, full: full})
		}
	case fzView:
		var v View
		if v, err = e.GradView(op.params[0]); err == nil {
			got := make([]float32, v.Count)
			if err = v.Read(got); err == nil {
				rr.lg.reads = append(rr.lg.reads, fzRead{op: i, step: rr.lastStep, kind: fzView, param: op.params[0], view: got, rg: v.ShardRange})
			}
		}
	case fzClose:
		err = e.Close()
		rr.lg.closed = true
	}
	return fzOut{class: fzClass(err), err: err}
}

// readViews enqueues copies of the gathered views on the stream that asked
// for them, as a forward reads them, without waiting: collectViews reads
// them at the end of the program (nil where that stream failed).
func (rr *fzRank) readViews(i int, s *HostStream, views []Tensor) {
	bufs := make([]*tbuf, len(views))
	for k, v := range views {
		bufs[k] = newTBuf(rr.c.dtype, v.Len())
		if v.Len() > 0 {
			if err := hostDev.copy(s, bufs[k].t(), v); err != nil {
				rr.lg.gathers[i] = nil
				return
			}
		}
	}
	rr.views = append(rr.views, fzViews{op: i, s: s, bufs: bufs})
}

type fzViews struct {
	op   int
	s    *HostStream
	bufs []*tbuf
}

func (rr *fzRank) collectViews() {
	for _, v := range rr.views {
		if err := v.s.Sync(); err != nil {
			rr.lg.gathers[v.op] = nil
			continue
		}
		out := make([][]uint32, len(v.bufs))
		for k, b := range v.bufs {
			out[k] = rr.bits(b)
		}
		rr.lg.gathers[v.op] = out
	}
	rr.views = nil
}

func (rr *fzRank) recordStep(i int, scale float64) {
	e := rr.e
	rec := &fzStepRec{scale: scale, stats: e.Stats()}
	rec.shard, rec.shardErr = e.GradShard()
	switch {
	case rr.c.memory && rr.c.stage < 3:
		for _, b := range rr.data {
			rec.params = append(rec.params, rr.bits(b))
		}
	case e.ps != nil:
		f32, f16 := e.ps.shard.HostFloat32s(), e.ps.shard.HostHalfs()
		for p := range rr.c.sizes {
			rg := e.plan.shardRange(p, rr.rank)
			bits := make([]uint32, rg.Count)
			for k := range rg.Count {
				if rr.c.dtype == FP32 {
					bits[k] = math.Float32bits(f32[rg.ShardOffset+k])
				} else {
					bits[k] = uint32(f16[rg.ShardOffset+k])
				}
			}
			rec.params = append(rec.params, bits)
		}
	}
	rr.lg.steps[i] = rec
	rr.lastStep = i
	rr.win = newFzWindow(rr.c.sizes)
}

// ---- the checks ---------------------------------------------------------------

// fzStats is one execution's line in ZERO_FUZZ_STATS.
type fzStats struct {
	World          int            `json:"world"`
	Stage          int            `json:"stage"`
	DType          string         `json:"dtype"`
	Opt            string         `json:"opt"`
	Offload        bool           `json:"offload"`
	Overlap        bool           `json:"overlap"`
	Sparse         bool           `json:"sparse"`
	Div            string         `json:"div"`   // the divergence configured ("" none)
	Fired          bool           `json:"fired"` // a configured fault fired
	InStep         bool           `json:"instep"`
	Ops            map[string]int `json:"ops"`
	Outcomes       map[string]int `json:"outcomes"` // over every rank's calls
	StepsOK        int            `json:"steps_ok"` // Step calls that succeeded on every rank
	StepsChecked   int            `json:"steps_checked"`
	ReadsChecked   int            `json:"reads_checked"`
	GathersChecked int            `json:"gathers_checked"`
	Timeouts       int            `json:"timeouts"`
	Hang           bool           `json:"hang"`
	Failed         bool           `json:"failed"`
	Millis         float64        `json:"ms"`
	// A failure's first problem and its input (hex): Go's fuzzing does not
	// report a failure met while it minimizes an interesting input.
	Problem string `json:"problem,omitempty"`
	Input   string `json:"input,omitempty"`
}

func (c *fzCase) newStats() *fzStats {
	st := &fzStats{World: c.world, Stage: c.stage, DType: c.dtype.String(), Opt: c.opt, Offload: c.cfg.Offload.Optimizer,
		Overlap: c.cfg.Overlap, Sparse: c.sparse, Div: c.div.kind, Ops: map[string]int{}, Outcomes: map[string]int{}}
	for _, op := range c.ops {
		st.Ops[op.kind.String()]++
	}
	return st
}

var fzStatsOut struct {
	once sync.Once
	mu   sync.Mutex
	f    *os.File
}

func fzWriteStats(st *fzStats) {
	path := os.Getenv("ZERO_FUZZ_STATS")
	if path == "" {
		return
	}
	fzStatsOut.once.Do(func() {
		fzStatsOut.f, _ = os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	})
	if fzStatsOut.f == nil {
		return
	}
	line, _ := json.Marshal(st)
	fzStatsOut.mu.Lock()
	fzStatsOut.f.Write(append(line, '\n')) // one write: lines of several workers do not interleave
	fzStatsOut.mu.Unlock()
}

func (c *fzCase) outcomeTable(logs []*fzLog) string {
	var b strings.Builder
	b.WriteString("outcomes (op: rank 0, rank 1, …):\n")
	for i, op := range c.ops {
		fmt.Fprintf(&b, "  %2d %-14s", i, op.kind)
		for _, lg := range logs {
			o := lg.out[i]
			switch {
			case !o.ran:
				b.WriteString(" | -")
			case o.dups > 0:
				fmt.Fprintf(&b, " | %s (+%d dup)", o.class, o.dups)
			default:
				fmt.Fprintf(&b, " | %s", o.class)
			}
		}
		b.WriteString("\n")
	}
	for r, lg := range logs {
		if lg.newErr != nil {
			fmt.Fprintf(&b, "  rank %d New: %v\n", r, lg.newErr)
		}
		if lg.faultOp >= 0 {
			fmt.Fprintf(&b, "  rank %d: the fault fired in op %d\n", r, lg.faultOp)
		}
		for i, o := range lg.out {
			if o.err != nil && o.class != "ErrProtocol" && o.class != "ErrClosed" {
				fmt.Fprintf(&b, "  rank %d op %d: %v\n", r, i, o.err)
			}
		}
	}
	return b.String()
}

// fzRef is the float64 mean of a step's window over every rank.
type fzRef struct {
	g         int
	mean, tol [][]float64
	poison    []bool
	anyPoison bool
}

func (c *fzCase) reference(wins []*fzWindow) *fzRef {
	g := wins[0].g
	ref := &fzRef{g: g, mean: make([][]float64, len(c.sizes)), tol: make([][]float64, len(c.sizes)), poison: make([]bool, len(c.sizes))}
	win := c.cfg.Window.DType
	if win == 0 {
		win = FP32
	}
	rtol := float64(c.world+2*g+8) * (unitRoundoff(c.dtype) + unitRoundoff(win) + unitRoundoff(FP32))
	atol := 0.0
	if c.dtype == FP16 {
		atol = float64(c.world+g+2) * math.Ldexp(1, -24)
	}
	div := float64(c.world * max(g, 1))
	for p, n := range c.sizes {
		ref.mean[p], ref.tol[p] = make([]float64, n), make([]float64, n)
		for _, w := range wins {
			ref.poison[p] = ref.poison[p] || w.poison[p]
			for i := range n {
				ref.mean[p][i] += w.sum[p][i]
				ref.tol[p][i] += w.mag[p][i]
			}
		}
		ref.anyPoison = ref.anyPoison || ref.poison[p]
		for i := range n {
			ref.mean[p][i] /= div
			ref.tol[p][i] = rtol*ref.tol[p][i]/div + atol
		}
	}
	return ref
}

func fzNear(got float32, want, tol float64) bool {
	return math.Abs(float64(got)-want) <= tol
}

// checkShard compares a rank's shard with the reference: the plan's
// elements of every bucket, padding and gaps zero.
func (c *fzCase) checkShard(plan *Plan, rank int, shard []float32, ref *fzRef) string {
	params := c.paramList()
	if len(shard) != plan.ShardElems {
		return fmt.Sprintf("shard of %d elements, the plan has %d", len(shard), plan.ShardElems)
	}
	for b, bp := range plan.Buckets {
		for j := range bp.Shard {
			got := shard[bp.ShardOffset+j]
			p, i := paramAt(plan, params, b, rank*bp.Shard+j)
			if p < 0 {
				if got != 0 {
					return fmt.Sprintf("bucket %d: padding element %d = %g, want 0", b, rank*bp.Shard+j, got)
				}
				continue
			}
			if !ref.poison[p] && !fzNear(got, ref.mean[p][i], ref.tol[p][i]) {
				return fmt.Sprintf("param %d[%d] = %g, want %g ± %g", p, i, got, ref.mean[p][i], ref.tol[p][i])
			}
		}
	}
	return ""
}

func (c *fzCase) checkFull(full [][]float32, ref *fzRef) string {
	if len(full) != len(c.sizes) {
		return fmt.Sprintf("%d parameters, want %d", len(full), len(c.sizes))
	}
	for p, g := range full {
		if len(g) != c.sizes[p] {
			return fmt.Sprintf("param %d has %d elements, want %d", p, len(g), c.sizes[p])
		}
		for i, v := range g {
			if !ref.poison[p] && !fzNear(v, ref.mean[p][i], ref.tol[p][i]) {
				return fmt.Sprintf("param %d[%d] = %g, want %g ± %g", p, i, v, ref.mean[p][i], ref.tol[p][i])
			}
		}
	}
	return ""
}

// firstStepAfter is the first Step op at or after op i (−1: none).
func (c *fzCase) firstStepAfter(i int) int {
	for j := max(i, 0); j < len(c.ops); j++ {
		if c.ops[j].kind == fzStep {
			return j
		}
	}
	return -1
}

var fzInStepAllowed = map[string]bool{"ok": true, "ErrProtocol": true, "ErrClosed": true, "omitted": true}

func (c *fzCase) check(logs []*fzLog, st *fzStats) []string {
	var problems []string
	bad := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	for _, lg := range logs {
		problems = append(problems, lg.problems...)
		for _, o := range lg.out {
			if o.ran {
				st.Outcomes[o.class]++
				if o.dups > 0 {
					st.Outcomes["ErrDuplicateGrad"] += o.dups
				}
			}
		}
		st.Timeouts += lg.timeouts
	}
	for r, lg := range logs {
		if lg.newErr != nil {
			bad("rank %d: New: %v", r, lg.newErr)
		}
	}
	if len(problems) > 0 {
		return problems
	}
	for r, lg := range logs {
		if lg.leaked != 0 {
			bad("rank %d: %d device bytes still allocated after Close", r, lg.leaked)
		}
	}
	// the parameters after New are rank 0's on every rank
	for r, lg := range logs {
		for p := range lg.afterNew {
			if !slices.Equal(lg.afterNew[p], logs[0].initial[p]) {
				bad("rank %d: parameter %d after New is not rank 0's", r, p)
			}
		}
	}

	// where the ranks stop being in step: D
	D := len(c.ops)
	fired := false
	switch {
	case c.div.fault():
		if f := logs[c.div.rank].faultOp; f >= 0 {
			fired, D = true, f
		}
	case c.div.kind != "":
		D = c.div.at
	}
	st.Fired = fired
	inStep := c.div.kind == "" || (c.div.fault() && !fired)
	st.InStep = inStep

	if inStep {
		for i := range c.ops {
			want := logs[0].out[i]
			for r, lg := range logs {
				o := lg.out[i]
				if !fzInStepAllowed[o.class] {
					bad("op %d (%s): rank %d: %s in step: %v", i, c.ops[i], r, o.class, o.err)
				}
				if o.class != "omitted" && want.class != "omitted" && o.class != want.class {
					bad("op %d (%s): rank 0 %s, rank %d %s (%v)", i, c.ops[i], want.class, r, o.class, o.err)
				}
			}
		}
		for r, lg := range logs {
			if lg.closeErr != nil {
				bad("rank %d: Close at the end of the program: %v", r, lg.closeErr)
			}
		}
	} else {
		q := c.div.rank
		switch {
		case c.div.kind == "skip" || c.div.kind == "close" || c.div.kind == "leave" || c.div.kind == "fault-return":
			from := D
			if c.div.kind == "skip" {
				from = c.div.end + 1
			}
			if c.div.kind == "fault-return" {
				if o := logs[q].out[D]; o.class != "injected" {
					bad("rank %d: the failed collective in op %d (%s) returned %s (%v), want the injected error", q, D, c.ops[D], o.class, o.err)
				}
				from = D + 1
			}
			if j := c.firstStepAfter(from); j >= 0 {
				for r, lg := range logs {
					if o := lg.out[j]; o.ran && o.class == "ok" {
						bad("rank %d: Step (op %d) succeeded after %s on rank %d at op %d", r, j, c.div.kind, q, D)
					}
				}
			}
		default: // fault-stream, fault-abort: the failing rank learns it by its next Step
			if j := c.firstStepAfter(D + 1); j >= 0 {
				if o := logs[q].out[j]; o.class == "ok" {
					bad("rank %d: Step (op %d) succeeded after its collective failed (%s) in op %d", q, j, c.div.kind, D)
				}
			}
		}
	}

	// The value checks: every Step that succeeded before the divergence (a
	// fault may fire in the Step itself), and the reads after it.
	refs := map[int]*fzRef{}
	var checkedSteps []int
	for i, op := range c.ops {
		if op.kind != fzStep || i > D || (i == D && !c.div.fault()) {
			continue
		}
		var wins []*fzWindow
		anyOK, allOK := false, true
		for _, lg := range logs {
			if w := lg.wins[i]; w != nil {
				wins = append(wins, w)
			}
			if lg.steps[i] != nil {
				anyOK = true
			} else {
				allOK = false
			}
		}
		if allOK {
			st.StepsOK++
		}
		if !anyOK || len(wins) != len(logs) {
			continue
		}
		for r, w := range wins {
			if w.g != wins[0].g {
				bad("Step (op %d) succeeded with rank 0 at %d backwards and rank %d at %d", i, wins[0].g, r, w.g)
			}
		}
		g := wins[0].g
		if g == 0 {
			bad("Step (op %d) succeeded with no backward", i)
			continue
		}
		if a := c.cfg.Grads.AccumSteps; a > 0 && g != a {
			bad("Step (op %d) succeeded after %d backwards with GradAccumSteps %d", i, g, a)
		}
		ref := c.reference(wins)
		refs[i] = ref
		checkedSteps = append(checkedSteps, i)
		st.StepsChecked++
		for r, lg := range logs {
			rec := lg.steps[i]
			if rec == nil {
				continue
			}
			if rec.shardErr != nil {
				if inStep {
					bad("rank %d: GradShard right after Step (op %d): %v", r, i, rec.shardErr)
				}
				continue
			}
			if msg := c.checkShard(lg.plan, r, rec.shard, ref); msg != "" {
				bad("rank %d: Step (op %d): shard: %s", r, i, msg)
			}
			if c.opt != "none" && rec.stats.Skipped != ref.anyPoison {
				bad("rank %d: Step (op %d): skipped %v with an inf gradient in the window: %v", r, i, rec.stats.Skipped, ref.anyPoison)
			}
		}
	}
	c.checkParams(logs, checkedSteps, refs, bad)

	// reads: against the reference of the step they read
	for r, lg := range logs {
		for _, rd := range lg.reads {
			ref := refs[rd.step]
			if ref == nil {
				continue
			}
			st.ReadsChecked++
			var msg string
			switch rd.kind {
			case fzShard:
				msg = c.checkShard(lg.plan, r, rd.shard, ref)
			case fzFull:
				msg = c.checkFull(rd.full, ref)
				if msg == "" && inStep && r > 0 {
					for _, o := range logs[0].reads {
						if o.op == rd.op && !fzSameFull(o.full, rd.full) {
							msg = "not the same bits as rank 0's"
						}
					}
				}
			case fzView:
				p := rd.param
				for k, v := range rd.view {
					i := rd.rg.ParamOffset + k
					if !ref.poison[p] && !fzNear(v, ref.mean[p][i], ref.tol[p][i]) {
						msg = fmt.Sprintf("param %d[%d] = %g, want %g ± %g", p, i, v, ref.mean[p][i], ref.tol[p][i])
						break
					}
					if rec := lg.steps[rd.step]; rec != nil && rec.shardErr == nil && math.Float32bits(rec.shard[rd.rg.ShardOffset+k]) != math.Float32bits(v) {
						msg = fmt.Sprintf("param %d[%d] = %g, the shard after the step has %g", p, i, v, rec.shard[rd.rg.ShardOffset+k])
						break
					}
				}
			}
			if msg != "" {
				bad("rank %d: %s (op %d) of the step at op %d: %s", r, rd.kind, rd.op, rd.step, msg)
			}
		}
	}
	if inStep {
		c.checkGathers(logs, st, bad)
	}
	return problems
}

func fzSameFull(a, b [][]float32) bool {
	return slices.EqualFunc(a, b, func(x, y []float32) bool {
		return slices.EqualFunc(x, y, func(u, v float32) bool { return math.Float32bits(u) == math.Float32bits(v) })
	})
}

// checkParams follows the parameters through the checked steps: SGD
// against p − lr·mean/S/coef in float64, AdamW finite; the same bits on
// every rank (stages 1-2); a skipped step changes nothing.
func (c *fzCase) checkParams(logs []*fzLog, steps []int, refs map[int]*fzRef, bad func(string, ...any)) {
	if c.opt == "none" {
		return
	}
	cur := make([][]float64, len(c.sizes))   // the float64 master
	slack := make([][]float64, len(c.sizes)) // its tolerance
	for p := range c.sizes {
		for _, u := range logs[0].initial[p] {
			cur[p] = append(cur[p], float64(refDecode(c.dtype, u)))
		}
		slack[p] = make([]float64, c.sizes[p])
	}
	prev := make([][][]uint32, len(logs)) // each rank's last snapshot
	u32, um := unitRoundoff(FP32), unitRoundoff(c.dtype)
	for _, i := range steps {
		ref := refs[i]
		allOK := true
		var scale float64 = -1
		for r, lg := range logs {
			rec := lg.steps[i]
			if rec == nil {
				allOK = false
				continue
			}
			if scale < 0 {
				scale = rec.scale
			} else if rec.scale != scale {
				bad("Step (op %d): rank %d's loss scale %v, another rank's %v", i, r, rec.scale, scale)
			}
		}
		if c.opt == "sgd" && !ref.anyPoison {
			sumsq, errsq := 0.0, 0.0
			for p := range c.sizes {
				for k, m := range ref.mean[p] {
					sumsq += m * m
					errsq += ref.tol[p][k] * ref.tol[p][k]
				}
			}
			norm, normTol := math.Sqrt(sumsq)/scale, (math.Sqrt(errsq)+1e-6*math.Sqrt(sumsq))/scale
			coef, coefRel := 1.0, 0.0
			if c.cfg.Optimizer.Clip > 0 && norm+normTol > c.cfg.Optimizer.Clip {
				coef = max(1, norm/c.cfg.Optimizer.Clip)
				coefRel = normTol/max(norm, 1e-30) + 1e-6
			}
			for r, lg := range logs {
				if rec := lg.steps[i]; rec != nil && !(math.Abs(rec.stats.GradNorm-norm) <= normTol+1e-12) {
					bad("rank %d: Step (op %d): norm %v, want %v ± %v", r, i, rec.stats.GradNorm, norm, normTol)
				}
			}
			f := c.lr / scale / coef
			for p := range c.sizes {
				for k, m := range ref.mean[p] {
					upd := f * m
					cur[p][k] -= upd
					slack[p][k] += f*ref.tol[p][k] + math.Abs(upd)*coefRel + 4*u32*(math.Abs(cur[p][k])+4*math.Abs(upd))
				}
			}
		}
		for r, lg := range logs {
			rec := lg.steps[i]
			if rec == nil || rec.params == nil {
				continue
			}
			if rec.stats.Skipped && prev[r] != nil && !slices.EqualFunc(prev[r], rec.params, slices.Equal) {
				bad("rank %d: Step (op %d) was skipped but the parameters changed", r, i)
			}
			prev[r] = rec.params
			for p, bits := range rec.params {
				off := 0
				if c.stage == 3 {
					off = lg.plan.shardRange(p, r).ParamOffset
				}
				for k, u := range bits {
					v := refDecode(c.dtype, u)
					if math.IsInf(float64(v), 0) || math.IsNaN(float64(v)) {
						bad("rank %d: Step (op %d): param %d[%d] = %v", r, i, p, off+k, v)
						return
					}
					if c.opt == "sgd" {
						want := cur[p][off+k]
						tol := slack[p][off+k] + 1.01*um*math.Abs(want)
						if c.dtype == FP16 {
							tol += math.Ldexp(1, -24)
						}
						if !fzNear(v, want, tol) {
							bad("rank %d: Step (op %d): SGD param %d[%d] = %v, want %v ± %v", r, i, p, off+k, v, want, tol)
							return
						}
					}
				}
			}
			if c.stage < 3 && r > 0 && logs[0].steps[i] != nil && !slices.EqualFunc(logs[0].steps[i].params, rec.params, slices.Equal) {
				bad("Step (op %d): rank %d's parameters are not rank 0's bits", i, r)
			}
		}
		if !allOK {
			return // the ranks part here: no reference for the next step
		}
	}
}

// checkGathers: stage 3's gathered parameters are the same bits on every
// rank, and those the last step left (rank 0's initial ones before it).
func (c *fzCase) checkGathers(logs []*fzLog, st *fzStats, bad func(string, ...any)) {
	if c.stage != 3 || !c.memory {
		return
	}
	state := slices.Clone(logs[0].initial)
	for i, op := range c.ops {
		if op.kind == fzStep && logs[0].steps[i] != nil && c.opt != "none" {
			// assemble the parameters from every rank's shard
			state = make([][]uint32, len(c.sizes))
			for p, n := range c.sizes {
				state[p] = make([]uint32, n)
				for r, lg := range logs {
					rec := lg.steps[i]
					if rec == nil || rec.params == nil {
						return
					}
					copy(state[p][lg.plan.shardRange(p, r).ParamOffset:], rec.params[p])
				}
			}
		}
		if op.kind != fzGather {
			continue
		}
		for r, lg := range logs {
			got, ok := lg.gathers[i]
			if !ok {
				continue
			}
			if len(got) != len(op.params) {
				bad("rank %d: Gather (op %d): reading the views on the stream failed", r, i)
				continue
			}
			st.GathersChecked++
			for k, p := range op.params {
				if !slices.Equal(got[k], state[p]) {
					bad("rank %d: Gather (op %d): parameter %d is not what the last step left", r, i, p)
					break
				}
			}
		}
	}
}

// ---- seeds, corpus, stats -------------------------------------------------------

// fzHead builds the config bytes.
type fzHead struct {
	world, stage, dtype, bucket int // world 2-4, stage 1-3, dtype 0 fp32 1 bf16 2 fp16, bucket an fzBuckets index
	flags                       byte
	accum, opt                  int // fzAccums, fzOpts indexes
	h, s                        byte
	sizes                       []int // fzSizes indexes
	seed                        uint16
	div, divRank, divTarget     byte
}

func (h fzHead) bytes() []byte {
	b := []byte{byte(h.world - 2), byte(h.stage - 1), byte(h.dtype), byte(h.bucket), h.flags, byte(h.accum), byte(h.opt), h.h, h.s, byte(len(h.sizes) - 1)}
	for i := range 5 {
		if i < len(h.sizes) {
			b = append(b, byte(h.sizes[i]))
		} else {
			b = append(b, 0)
		}
	}
	return append(b, byte(h.seed), byte(h.seed>>8), h.div, h.divRank, h.divTarget)
}

func fzProgram(h fzHead, ops ...byte) []byte { return append(h.bytes(), ops...) }

// fzNamedSeeds are the corpus files: sequences that found bugs, and ones
// worth keeping in every run.
func fzNamedSeeds() map[string][]byte {
	const (
		bwd, step, coalesce, nosync, read = fzCodeBackward, fzCodeStep, fzCodeCoalesce, fzCodeNoSync, fzCodeRead
		silent1                           = 64 // backward flag: rank (a2>>3)%W reports nothing; a2 = 8 → rank 1
		full                              = 1  // read argument: FullGrads of parameter 0
	)
	stage1 := fzHead{world: 2, stage: 1, bucket: 4, flags: 1, sizes: []int{2, 1, 4, 0}}
	return map[string][]byte{
		// stage 1, 2 ranks: rank 1 reports nothing in a step, then Step
		"rank-without-gradient-whole-step": fzProgram(stage1, bwd, silent1, 8, bwd, silent1, 8, step, read, full,
			bwd, silent1, 8, step, read, full),
		// … or only in the step's last backward
		"rank-without-gradient-last-backward": fzProgram(stage1, bwd, 0, 0, bwd, silent1, 8, step, read, full),
		// NoSync: rank 1 reports nothing in the backward after EndNoSync
		"rank-without-gradient-after-nosync": fzProgram(stage1, nosync, 0, 0, 0, silent1, 8, step, read, full),
		"rank-without-gradient-coalesce":     fzProgram(stage1, coalesce, 1, 0, 0, silent1, 8, step, read, full),
	}
}

// fzSeeds are f.Add's: a plain training loop at every stage, dtype and
// optimizer, windows, stage-3 gathers, refusals and each divergence.
func fzSeeds() [][]byte {
	const (
		bwd, step, coalesce, nosync, read  = fzCodeBackward, fzCodeStep, fzCodeCoalesce, fzCodeNoSync, fzCodeRead
		grads, end, boundary, gather, rel  = fzCodeGrads, fzCodeEnd, fzCodeBoundary, fzCodeGather, fzCodeRelease
		forward, closeAll, poison, shuffle = fzCodeForward, fzCodeClose, fzCodePoison, 1
	)
	var seeds [][]byte
	loop := []byte{bwd, shuffle | 4, 0, bwd, 2, 0, step, read, 1, read, 0, bwd, 8, 0, step, read, 2}
	for stage := 1; stage <= 3; stage++ {
		for dt := range 3 {
			for _, opt := range []int{0, 2, 3} {
				h := fzHead{world: 2 + (stage+dt)%3, stage: stage, dtype: dt, bucket: (stage + opt) % 5, flags: byte(1 + 2*(dt%2) + 128*(stage/3)),
					opt: opt, h: byte(opt * 5), s: byte(stage + 4*dt), sizes: []int{2, 1, 4, 7, 0}[:2+(stage+opt)%4], seed: uint16(stage*100 + dt*10 + opt)}
				seeds = append(seeds, fzProgram(h, loop...))
			}
		}
	}
	h := fzHead{world: 3, stage: 2, dtype: 1, bucket: 1, flags: 1 | 16, sizes: []int{2, 6, 4}, seed: 7}
	seeds = append(seeds,
		fzProgram(h, coalesce, 2, 1, 0, 4, 0, 8, 0, step, read, 1, nosync, 1, 0, 0, 0, 0, 1, 0, step, read, 1),
		fzProgram(h, grads, 0, 1, grads, 0, 0, grads, 0, 1, grads, 1, 2, 2, end, step, read, 1), // duplicates
		fzProgram(h, step, bwd, 0, 0, coalesce, 0, 0, 0, step, fzCodeEndNoSync, read, 1),        // refusals
		fzProgram(h, bwd, 0, 0, boundary, 0, bwd, 16, 0, step, read, 0, closeAll, step),
	)
	sgd := fzHead{world: 2, stage: 1, bucket: 1, flags: 1, opt: 2, sizes: []int{2, 6, 4}, seed: 8}
	seeds = append(seeds, fzProgram(sgd, grads, 0, 1, poison, 1, 0, 0, end, step, read, 1, bwd, 0, 0, step))
	s3 := fzHead{world: 2, stage: 3, bucket: 1, flags: 1, opt: 2, sizes: []int{2, 4, 1}, seed: 9}
	seeds = append(seeds,
		fzProgram(s3, forward, bwd, 128, 0, step, forward, bwd, 128, 0, step, gather, 0, 1, step, rel, 0, 1, step),
		fzProgram(fzHead{world: 4, stage: 3, dtype: 2, bucket: 2, flags: 1 | 12, opt: 3, h: 0x2c, sizes: []int{4, 2, 7}, seed: 11},
			forward, bwd, 1, 0, bwd, 2, 0, step, forward, step, read, 1),
	)
	// Step right after EndNoSync (it reduces what NoSync accumulated), then
	// windows again; a collective failing on the stream of a backward
	// without overlap, then Step
	n := fzHead{world: 2, stage: 2, bucket: 1, flags: 1, sizes: []int{8, 8, 1}, seed: 5}
	seeds = append(seeds,
		fzProgram(n, fzCodeBeginNoSync, bwd, 0, 0, fzCodeEndNoSync, step, read, 1, coalesce, 0, 0, 0, step, read, 1,
			fzCodeBeginNoSync, bwd, 0, 0, fzCodeEndNoSync, step, fzCodeBeginNoSync, bwd, 0, 0, fzCodeEndNoSync, bwd, 0, 0, step, read, 0),
		fzProgram(fzHead{world: 2, stage: 2, bucket: 1, sizes: []int{8, 8}, seed: 6, div: byte(fzDivFrom + 5), divRank: 1},
			bwd, 0, 0, step, read, 1, bwd, 0, 0, step),
		fzProgram(fzHead{world: 3, stage: 1, bucket: 1, sizes: []int{8, 8}, seed: 6, div: byte(fzDivFrom + 5), divRank: 2, divTarget: 1},
			bwd, 0, 0, bwd, 0, 0, step, read, 1, bwd, 0, 0, step),
	)
	// each divergence
	for k := range len(fzDivs) - 2 {
		d := fzHead{world: 2 + k%3, stage: 1 + k%3, bucket: 1, flags: byte(k % 2), opt: []int{0, 2, 3}[k%3], sizes: []int{2, 4}, seed: uint16(k),
			div: byte(fzDivFrom + k), divRank: byte(k), divTarget: byte(k)}
		seeds = append(seeds, fzProgram(d, bwd, 0, 0, bwd, 1, 0, step, read, 1, bwd, 0, 0, step, read, 1))
	}
	return seeds
}

// TestFuzzWriteCorpus writes fzNamedSeeds into testdata/fuzz/FuzzProtocol
// (with ZERO_FUZZ_WRITE_CORPUS=1).
func TestFuzzWriteCorpus(t *testing.T) {
	if os.Getenv("ZERO_FUZZ_WRITE_CORPUS") == "" {
		t.Skip("set ZERO_FUZZ_WRITE_CORPUS=1 to write the named seeds")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzProtocol")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, b := range fzNamedSeeds() {
		body := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", b)
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s:\n%s", name, fzDecode(b))
	}
}

// TestFuzzStatsSummary summarises the lines FuzzProtocol appended to
// ZERO_FUZZ_STATS (run it with -v).
func TestFuzzStatsSummary(t *testing.T) {
	path := os.Getenv("ZERO_FUZZ_STATS")
	if path == "" {
		t.Skip("set ZERO_FUZZ_STATS to the file FuzzProtocol wrote")
	}
	f, err := os.Open(path)
	if err != nil {
		t.Skip(err)
	}
	defer f.Close()
	var n, inStep, failed, hangs, fired, timeouts, stepsOK, stepsChecked, reads, gathers int
	var ms float64
	var failures []fzStats
	ops, outcomes, stages, divs, dtypes, opts, worlds := map[string]int{}, map[string]int{}, map[string]int{}, map[string]int{}, map[string]int{}, map[string]int{}, map[string]int{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var st fzStats
		if json.Unmarshal(sc.Bytes(), &st) != nil {
			continue
		}
		n++
		if st.InStep {
			inStep++
		}
		if st.Failed {
			failed++
			if len(failures) < 5 && !slices.ContainsFunc(failures, func(f fzStats) bool { return f.Problem == st.Problem }) {
				failures = append(failures, st)
			}
		}
		if st.Hang {
			hangs++
		}
		if st.Fired {
			fired++
		}
		if st.Timeouts > 0 {
			timeouts++
		}
		stepsOK += st.StepsOK
		stepsChecked += st.StepsChecked
		reads += st.ReadsChecked
		gathers += st.GathersChecked
		ms += st.Millis
		for k, v := range st.Ops {
			ops[k] += v
		}
		for k, v := range st.Outcomes {
			outcomes[k] += v
		}
		stages[fmt.Sprint("ZeRO-", st.Stage)]++
		worlds[fmt.Sprint(st.World, " ranks")]++
		dtypes[st.DType]++
		opts[st.Opt]++
		div := st.Div
		if div == "" {
			div = "none"
		} else if strings.HasPrefix(div, "fault") && !st.Fired {
			div += " (never fired)"
		}
		divs[div]++
	}
	if n == 0 {
		t.Skip("no executions recorded")
	}
	pct := func(k int) string { return fmt.Sprintf("%d (%.1f%%)", k, 100*float64(k)/float64(n)) }
	dist := func(m map[string]int) string {
		keys := make([]string, 0, len(m))
		total := 0
		for k, v := range m {
			keys = append(keys, k)
			total += v
		}
		sort.Slice(keys, func(i, j int) bool { return m[keys[i]] > m[keys[j]] })
		var parts []string
		for _, k := range keys {
			parts = append(parts, fmt.Sprintf("%s %d (%.1f%%)", k, m[k], 100*float64(m[k])/float64(total)))
		}
		return strings.Join(parts, ", ")
	}
	t.Logf("executions: %d (mean %.1f ms each)", n, ms/float64(n))
	t.Logf("in step: %s; failed: %d; hangs: %d; with a collective timeout: %d; faults fired: %d", pct(inStep), failed, hangs, timeouts, fired)
	t.Logf("Steps that succeeded on every rank: %d; Steps checked against float64: %d; reads checked: %d; gathers checked: %d", stepsOK, stepsChecked, reads, gathers)
	t.Logf("operations: %s", dist(ops))
	t.Logf("outcomes (per rank and call): %s", dist(outcomes))
	t.Logf("stages: %s", dist(stages))
	t.Logf("world sizes: %s", dist(worlds))
	t.Logf("dtypes: %s", dist(dtypes))
	t.Logf("optimizers: %s", dist(opts))
	t.Logf("injected divergences: %s", dist(divs))
	// Go's fuzzing takes a failure met while minimizing an interesting input
	// for a flake and does not report it: these lines do.
	for _, f := range failures {
		b, _ := hex.DecodeString(f.Input)
		t.Errorf("a failed execution: %s\n  replay it as a file in testdata/fuzz/FuzzProtocol:\ngo test fuzz v1\n[]byte(%q)", f.Problem, b)
	}
}

// ---- fuzzing what a loader reads ----------------------------------------------
//
// The readers of files fuzzed one at a time: a checkpoint's manifest, a rank
// file's footer, a whole rank file, a safetensors file. Each input becomes
// that file of an otherwise good checkpoint (the golden one of the current
// format version), its checksums recomputed where the input parses, so the
// checks behind the checksums are reached. Each execution checks: no panic;
// the heap allocated across the call (runtime/metrics /gc/heap/allocs:bytes)
// at most 64 times the bytes of the files plus 1 MiB; and a refusal is
// ErrCheckpoint, never fatal, with the engine's state bit for bit as before
// (a one-rank engine of the golden checkpoint's model, also resharding it:
// it reads both rank files). The seed corpora are in testdata/fuzz; plain
// go test runs them.
//
//	go test -run '^$' -fuzz FuzzCheckpointManifest -fuzztime 5m .

// fuzzCkptEnv is the golden checkpoint's files and an engine that loaded
// them (state: its state after that load).
type fuzzCkptEnv struct {
	files  map[string][]byte
	total  int // bytes of the files
	e      *Engine
	state  ckptState
	golden string
}

var fuzzCkpt = sync.OnceValues(func() (*fuzzCkptEnv, error) {
	env := &fuzzCkptEnv{files: map[string][]byte{}, golden: fmt.Sprintf("testdata/checkpoint-v%d", ckptVersion)}
	for _, name := range []string{ckptManifest, rankFileName(0), rankFileName(1)} {
		b, err := os.ReadFile(filepath.Join(env.golden, name))
		if err != nil {
			return nil, err
		}
		env.files[name] = b
		env.total += len(b)
	}
	comms, err := NewLocalGroup(1)
	if err != nil {
		return nil, err
	}
	a := NewAdamW(1e-2) // the golden run's settings (checkpoint_test.go's goldenCase)
	a.AMSGrad, a.WeightDecay = true, 0.01
	cfg := Config{Stage: 2, BucketBytes: 1024, Overlap: true, Optimizer: OptimizerPolicy{Groups: []Optimizer{a}, Clip: 5}}
	cfg.Precision.LossScale = LossScale{Initial: 256, Window: 2, Hysteresis: 2, Min: 1}
	var ps []Param
	for p, n := range []int{300, 7, 1000, 129, 64} {
		ps = append(ps, Param{Name: fmt.Sprint("w", p), Count: n, DType: FP16, Data: Halfs(make([]uint16, n), FP16)})
	}
	if env.e, err = New(cfg, comms[0], ps); err != nil {
		return nil, err
	}
	if err := env.reset(); err != nil {
		return nil, err
	}
	return env, nil
})

// reset loads the golden checkpoint again and notes the state.
func (env *fuzzCkptEnv) reset() error {
	if _, err := env.e.Load(env.golden, LoadOptions{}); err != nil {
		return err
	}
	var err error
	env.state, err = readCkptState(env.e)
	return err
}

// sameState reports where two states of one engine differ ("" if nowhere).
func sameState(a, b ckptState) string {
	for name, x := range a.state {
		if !slices.Equal(x, b.state[name]) {
			return "state " + name
		}
	}
	for p := range a.params {
		if !slices.EqualFunc(a.params[p], b.params[p], func(x, y float32) bool { return math.Float32bits(x) == math.Float32bits(y) }) {
			return fmt.Sprintf("parameter %d", p)
		}
	}
	if !slices.Equal(a.steps, b.steps) || a.scaler != b.scaler || a.step != b.step {
		return "steps or scaler"
	}
	return ""
}

// resealed is data, a manifest, with its checksum recomputed where it
// parses, and edit (if set) applied first; data as is where it does not.
func resealed(data []byte, edit func(*ckptManifestData)) []byte {
	var m ckptManifestData
	if json.Unmarshal(data, &m) != nil {
		return data
	}
	if edit != nil {
		edit(&m)
	}
	out, err := sealManifest(&m)
	if err != nil {
		return data
	}
	return out
}

// fuzzLoad writes files (the golden ones, overridden) into a directory of
// t's, loads it into the engine and exports it without one, and checks
// what the fuzzers promise (see above).
func fuzzLoad(t *testing.T, files map[string][]byte) {
	env, err := fuzzCkpt()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	size := 0
	for name, b := range env.files {
		if over, ok := files[name]; ok {
			b = over
		}
		size += len(b)
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	limit := 64*uint64(size) + 1<<20
	before := heapAllocs()
	_, lerr := env.e.Load(dir, LoadOptions{})
	if grown := heapAllocs() - before; grown > limit {
		t.Fatalf("Load allocated %d bytes for %d bytes of files (at most %d): %v", grown, size, limit, lerr)
	}
	if lerr != nil {
		if !errors.Is(lerr, ErrCheckpoint) || errors.Is(lerr, ErrCollective) {
			t.Fatalf("Load: %v; want a refusal (ErrCheckpoint), the engine usable", lerr)
		}
		st, err := readCkptState(env.e)
		if err != nil {
			t.Fatal(err)
		}
		if d := sameState(env.state, st); d != "" {
			t.Fatalf("a refused Load (%v) changed the engine: %s", lerr, d)
		}
	} else if err := env.reset(); err != nil { // it loaded: start the next from the golden state
		t.Fatal(err)
	}
	before = heapAllocs()
	xerr := checkpointToSafetensors(osFS{}, dir, filepath.Join(dir, "out.safetensors"), ExportOptions{Optimizer: true})
	if grown := heapAllocs() - before; grown > limit {
		t.Fatalf("CheckpointToSafetensors allocated %d bytes for %d bytes of files (at most %d): %v", grown, size, limit, xerr)
	}
	if xerr != nil && !errors.Is(xerr, ErrCheckpoint) {
		t.Fatalf("CheckpointToSafetensors: %v; want ErrCheckpoint", xerr)
	}
}

// FuzzCheckpointManifest: any manifest.json, resealed where it parses.
func FuzzCheckpointManifest(f *testing.F) {
	env, err := fuzzCkpt()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(env.files[ckptManifest])
	f.Fuzz(func(t *testing.T, data []byte) {
		fuzzLoad(t, map[string][]byte{ckptManifest: resealed(data, nil)})
	})
}

// rankFileParts splits a rank file into its sections' bytes and its footer.
func rankFileParts(b []byte) (body, footer []byte) {
	tr := b[len(b)-ckptTrailerLen:]
	at, n := binary.LittleEndian.Uint64(tr), binary.LittleEndian.Uint64(tr[8:])
	return b[:at], b[at : at+n]
}

// withRankFile is the golden files with rank 0's file replaced by file and
// the manifest's size and CRC32C of it, resealed.
func withRankFile(env *fuzzCkptEnv, file []byte) map[string][]byte {
	return map[string][]byte{rankFileName(0): file, ckptManifest: resealed(env.files[ckptManifest], func(m *ckptManifestData) {
		if len(m.Files) > 0 {
			m.Files[0].Bytes, m.Files[0].CRC = int64(len(file)), crc32.Checksum(file, castagnoli)
		}
	})}
}

// FuzzCheckpointFooter: any footer of rank 0's file, behind its sections,
// with a trailer that points at it and its checksum, the manifest's size
// and CRC32C of the file recomputed.
func FuzzCheckpointFooter(f *testing.F) {
	env, err := fuzzCkpt()
	if err != nil {
		f.Fatal(err)
	}
	_, footer := rankFileParts(env.files[rankFileName(0)])
	f.Add(footer)
	f.Fuzz(func(t *testing.T, footer []byte) {
		body, _ := rankFileParts(env.files[rankFileName(0)])
		file := append(slices.Clone(body), footer...)
		var tr [ckptTrailerLen]byte
		binary.LittleEndian.PutUint64(tr[0:], uint64(len(body)))
		binary.LittleEndian.PutUint64(tr[8:], uint64(len(footer)))
		binary.LittleEndian.PutUint32(tr[16:], crc32.Checksum(footer, castagnoli))
		copy(tr[20:], ckptTrailerTag)
		fuzzLoad(t, withRankFile(env, append(file, tr[:]...)))
	})
}

// FuzzCheckpointRankFile: any rank 0 file, the manifest's size and CRC32C
// of it recomputed.
func FuzzCheckpointRankFile(f *testing.F) {
	env, err := fuzzCkpt()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(env.files[rankFileName(0)])
	f.Fuzz(func(t *testing.T, file []byte) {
		fuzzLoad(t, withRankFile(env, file))
	})
}

// FuzzImportSafetensors: any file given to ImportSafetensors, for a model
// of an fp32 matrix and a bf16 vector, with Convert or without; at stage 2
// into their Data, at stage 3 through the Init it sets (asked for each
// parameter whole, as a one-rank New would). A refusal leaves Data (and
// Init) as they were; a file accepted without Convert holds the values
// read, exactly.
func FuzzImportSafetensors(f *testing.F) {
	f.Add([]byte("\x10\x00\x00\x00\x00\x00\x00\x00{}              "), false)
	f.Fuzz(func(t *testing.T, data []byte, convert bool) {
		path := filepath.Join(t.TempDir(), "m.safetensors")
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
		limit := 64*uint64(len(data)) + 1<<20
		w, b := make([]float32, 6), make([]uint16, 3)
		for i := range w {
			w[i] = float32(i) + 0.5
		}
		for i := range b {
			b[i] = 0x3f80 + uint16(i)
		}
		ws, bs := slices.Clone(w), slices.Clone(b)
		ps := []Param{{Name: "w", Count: 6, Shape: []int{2, 3}, DType: FP32, Data: Float32s(w)}, {Name: "b", Count: 3, DType: BF16, Data: Halfs(b, BF16)}}
		before := heapAllocs()
		err := ImportSafetensors(path, Config{Stage: 2}, CPU(), ps, ImportOptions{Convert: convert})
		if grown := heapAllocs() - before; grown > limit {
			t.Fatalf("ImportSafetensors allocated %d bytes for %d bytes (at most %d): %v", grown, len(data), limit, err)
		}
		if err != nil {
			if !errors.Is(err, ErrCheckpoint) {
				t.Fatalf("ImportSafetensors: %v; want ErrCheckpoint", err)
			}
			if !slices.Equal(w, ws) || !slices.Equal(b, bs) || ps[0].Init != nil || ps[1].Init != nil {
				t.Fatalf("a refused import (%v) changed the parameters", err)
			}
		} else if !convert { // the bytes of each tensor, as the header places them
			h, herr := readSTHeader(bytes.NewReader(data), int64(len(data)), path)
			if herr != nil {
				t.Fatalf("the file imported, its header does not read: %v", herr)
			}
			for i, got := range [][]byte{ps[0].Data.hostBytes(), ps[1].Data.hostBytes()} {
				tn, _ := h.find(ps[i].Name)
				if want := data[h.DataStart+tn.Begin : h.DataStart+tn.End]; !bytes.Equal(got, want) {
					t.Fatalf("parameter %q holds %x, the file %x", ps[i].Name, got, want)
				}
			}
		}
		// stage 3: Init reads the ranges New asks for
		ps3 := []Param{{Name: "w", Count: 6, Shape: []int{2, 3}, DType: FP32}, {Name: "b", Count: 3, DType: BF16}}
		before = heapAllocs()
		err3 := ImportSafetensors(path, Config{Stage: 3}, CPU(), ps3, ImportOptions{Convert: convert})
		for _, p := range ps3 {
			if err3 == nil && p.Init != nil {
				if ierr := p.Init(make([]float32, p.Count), 0); ierr != nil && !errors.Is(ierr, ErrCheckpoint) {
					t.Fatalf("Init: %v; want ErrCheckpoint", ierr)
				}
			}
		}
		if grown := heapAllocs() - before; grown > limit {
			t.Fatalf("a stage-3 import and its Init allocated %d bytes for %d bytes (at most %d)", grown, len(data), limit)
		}
		if (err == nil) != (err3 == nil) {
			t.Fatalf("stage 2 and stage 3 disagree on the file: %v / %v", err, err3)
		}
		if err3 != nil && (ps3[0].Init != nil || ps3[1].Init != nil) {
			t.Fatalf("a refused import (%v) set an Init", err3)
		}
	})
}
