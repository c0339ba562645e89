package zero

import (
	"fmt"
	"math"
	"sync"
	"time"
)

// DefaultTimeout bounds how long a collective of an in-process group waits
// for its peers.
const DefaultTimeout = 5 * time.Minute

// abortLatch is an in-process group's first failure: it is set once, and
// every rank's waits and later collectives see it. Its mutex is the group's
// own, so a rank's arrival at a rendezvous and an abort never interleave.
type abortLatch struct {
	mu      sync.Mutex
	reason  error
	aborted chan struct{}
}

func newAbortLatch() abortLatch { return abortLatch{aborted: make(chan struct{})} }

// abort records err as the group's failure, unless one is recorded already.
func (l *abortLatch) abort(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.abortLocked(err)
}

// abortLocked is abort with mu held.
func (l *abortLatch) abortLocked(err error) {
	if l.reason == nil {
		l.reason = err
		close(l.aborted)
	}
}

// abortErr is the group's failure, or nil.
func (l *abortLatch) abortErr() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.reason
}

// aborter is a communicator that can be aborted from any goroutine: its
// blocked and later collectives, and its peers', fail promptly. The in-process
// groups, NCCL and MPI are.
type aborter interface {
	abort(reason error)
}

// AbortComm aborts comm from any goroutine: every blocked and later
// collective of every rank of its group fails promptly, with an error
// wrapping reason, instead of waiting for the group's timeout: ErrAborted
// on this rank, ErrPeerFailed on the others. The in-process groups, NCCL
// (whose peers hear it through the bootstrap's connections) and MPI
// support it; a Comm of the caller's own is aborted through its
// Abort(error) method if it has one, and otherwise AbortComm does nothing.
// Engine.Abort calls it.
func AbortComm(comm Comm, reason error) {
	switch c := comm.(type) {
	case aborter:
		c.abort(reason)
	case interface{ Abort(error) }:
		c.Abort(reason)
	}
}

// Comm is one rank's communicator. Collectives are enqueued on a stream of
// the communicator's device and return at once; errors that happen while
// they run (a peer failed, a timeout) fail the stream, and its Sync says so.
type Comm interface {
	// Rank is this rank's index in the group, 0 to Size()−1.
	Rank() int
	// Size is the number of ranks W.
	Size() int
	// Device is where the collectives' buffers live and their streams run.
	Device() Device
	// AllReduce reduces buf across ranks in place.
	AllReduce(s Stream, buf Tensor, op ReduceOp) error
	// ReduceScatter reduces send (Size()·recv.Len() elements) across ranks
	// and leaves chunk Rank() in recv. recv may be that chunk of send.
	ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error
	// AllGather concatenates every rank's send into recv (Size()·send.Len()).
	// send may be chunk Rank() of recv.
	AllGather(s Stream, send, recv Tensor) error
	// Broadcast copies root's buf into every rank's buf.
	Broadcast(s Stream, buf Tensor, root int) error
	// Counters returns what this rank has moved so far.
	Counters() CommCounters
	// Close leaves the group. Peers' pending and later collectives fail.
	Close() error
}

// asyncFailer is a communicator that can fail after its collectives were
// enqueued, such that their events still fire (NCCL aborted by its
// watchdog): asyncErr reports that failure.
type asyncFailer interface {
	asyncErr() error
}

// CollectiveKind names a collective in the counters.
type CollectiveKind int

// The collectives the counters tell apart.
const (
	KindAllReduce CollectiveKind = iota
	KindReduceScatter
	KindAllGather
	KindBroadcast
	numKinds
)

// String names the kind as NCCL does, e.g. "reduce_scatter".
func (k CollectiveKind) String() string {
	return [...]string{"all_reduce", "reduce_scatter", "all_gather", "broadcast"}[k]
}

// CollectiveCount is what one kind of collective moved on one rank.
// PayloadBytes is the size of the full buffer (the input of a
// reduce-scatter, the output of an all-gather). WireBytes follows the ring
// model: reduce-scatter, all-gather and broadcast send (W−1)/W of the
// payload per rank, all-reduce twice that.
type CollectiveCount struct {
	Calls        int64 // collectives issued
	PayloadBytes int64 // bytes of their full buffers
	WireBytes    int64 // bytes each rank sends, in the ring model
}

// CommCounters holds one count per collective kind.
type CommCounters [numKinds]CollectiveCount

// Total sums all kinds.
func (c CommCounters) Total() CollectiveCount {
	var t CollectiveCount
	for _, k := range c {
		t.Calls += k.Calls
		t.PayloadBytes += k.PayloadBytes
		t.WireBytes += k.WireBytes
	}
	return t
}

// Add returns c + d.
func (c CommCounters) Add(d CommCounters) CommCounters {
	for i := range c {
		c[i].Calls += d[i].Calls
		c[i].PayloadBytes += d[i].PayloadBytes
		c[i].WireBytes += d[i].WireBytes
	}
	return c
}

// Sub returns c − base, the traffic since base was read.
func (c CommCounters) Sub(base CommCounters) CommCounters {
	for i := range c {
		c[i].Calls -= base[i].Calls
		c[i].PayloadBytes -= base[i].PayloadBytes
		c[i].WireBytes -= base[i].WireBytes
	}
	return c
}

// counters is the shared bookkeeping of every Comm implementation.
type counters struct {
	mu sync.Mutex
	c  CommCounters
}

func (c *counters) add(kind CollectiveKind, payloadBytes, world int) {
	c.mu.Lock()
	c.c.add(kind, payloadBytes, world)
	c.mu.Unlock()
}

// add counts one collective of payloadBytes among world ranks.
func (c *CommCounters) add(kind CollectiveKind, payloadBytes, world int) {
	wire := int64(0)
	if world > 1 {
		wire = int64(payloadBytes) * int64(world-1) / int64(world)
		if kind == KindAllReduce {
			wire *= 2
		}
	}
	c[kind].Calls++
	c[kind].PayloadBytes += int64(payloadBytes)
	c[kind].WireBytes += wire
}

func (c *counters) snapshot() CommCounters {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.c
}

// collective is one validated call, as every communicator receives it.
type collective struct {
	kind       CollectiveKind
	op         ReduceOp
	root       int
	send, recv Tensor // the same tensor for all-reduce and broadcast
}

// payload is the bytes of the full buffer, for the counters.
func (x collective) payload() int { return max(x.send.Bytes(), x.recv.Bytes()) }

// collArgs is the plain-integer form the in-process groups share between ranks.
type collArgs struct {
	kind  CollectiveKind
	op    ReduceOp
	root  int
	dtype DType
	count int // elements of send
	send  uintptr
	recv  uintptr
}

func (x collective) args() collArgs {
	return collArgs{kind: x.kind, op: x.op, root: x.root, dtype: x.send.dtype, count: x.send.count, send: x.send.ptr, recv: x.recv.ptr}
}

// buffers are the memory a collective of world ranks reads and writes, as
// device tensors (for the quarantine of a failed one).
func (a collArgs) buffers(world int) []Tensor {
	n := a.count
	switch a.kind {
	case KindAllGather:
		n *= world
	case KindReduceScatter:
		n /= max(world, 1)
	}
	return []Tensor{{ptr: a.send, count: a.count, dtype: a.dtype}, {ptr: a.recv, count: n, dtype: a.dtype}}
}

func (a collArgs) String() string {
	return fmt.Sprintf("%v(%d × %v, %v)", a.kind, a.count, a.dtype, a.op)
}

// collectives implements Comm's four collectives for every communicator:
// it checks each call the same way and hands it to issue.
type collectives struct {
	world int
	issue func(s Stream, x collective) error
}

func (c collectives) AllReduce(s Stream, buf Tensor, op ReduceOp) error {
	if err := checkCollective("AllReduce", op, buf); err != nil {
		return err
	}
	return c.issue(s, collective{kind: KindAllReduce, op: op, send: buf, recv: buf})
}

func (c collectives) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	if err := checkCollective("ReduceScatter", op, send, recv); err != nil {
		return err
	}
	if send.count != recv.count*c.world {
		return errorf(ErrGradSize, "ReduceScatter: send has %d elements, recv %d; send must hold world size (%d) × recv", send.count, recv.count, c.world)
	}
	return c.issue(s, collective{kind: KindReduceScatter, op: op, send: send, recv: recv})
}

func (c collectives) AllGather(s Stream, send, recv Tensor) error {
	if err := checkCollective("AllGather", OpSum, send, recv); err != nil {
		return err
	}
	if recv.count != send.count*c.world {
		return errorf(ErrGradSize, "AllGather: send has %d elements, recv %d; recv must hold world size (%d) × send", send.count, recv.count, c.world)
	}
	return c.issue(s, collective{kind: KindAllGather, send: send, recv: recv})
}

func (c collectives) Broadcast(s Stream, buf Tensor, root int) error {
	if err := checkCollective("Broadcast", OpSum, buf); err != nil {
		return err
	}
	if root < 0 || root >= c.world {
		return errorf(ErrConfig, "Broadcast: root %d; use a rank in [0, %d)", root, c.world)
	}
	return c.issue(s, collective{kind: KindBroadcast, root: root, send: buf, recv: buf})
}

func checkCollective(name string, op ReduceOp, ts ...Tensor) error {
	if op < OpSum || op > OpMax {
		return errorf(ErrConfig, "%s: op %v; use OpSum, OpAvg or OpMax", name, op)
	}
	for _, t := range ts {
		if !t.dtype.valid() {
			return errorf(ErrDType, "%s: dtype %v; use fp32, bf16 or fp16", name, t.dtype)
		}
		if t.dtype != ts[0].dtype {
			return errorf(ErrDType, "%s: buffers of %v and %v; give both the same dtype", name, ts[0].dtype, t.dtype)
		}
	}
	return nil
}

// AllReduceScalars reduces a few of the caller's own values (a loss, a
// metric) across the ranks of comm with op, in float64 and the same on
// every rank: each rank's values travel in one all-gather as (mantissa
// high, mantissa low, exponent), 48 of float64's 53 bits and its whole
// range, and every rank combines them in rank order in float64. OpAvg divides the sum by the world size. It is a collective on
// comm: every rank calls it, at the same point between the engine's calls
// (which share comm). Its traffic is not in the engine's stats.
func AllReduceScalars(comm Comm, op ReduceOp, values ...float64) ([]float64, error) {
	if comm == nil {
		return nil, errorf(ErrConfig, "AllReduceScalars: nil Comm")
	}
	if op < OpSum || op > OpMax {
		return nil, errorf(ErrConfig, "AllReduceScalars: op %v; use OpSum, OpAvg or OpMax", op)
	}
	const words = 3
	n, world, rank, dev := len(values), comm.Size(), comm.Rank(), comm.Device()
	if n == 0 {
		return nil, nil
	}
	s, err := dev.NewStream()
	if err != nil {
		return nil, err
	}
	defer s.Close()
	buf, err := dev.Alloc(words*n*world, FP32)
	if err != nil {
		return nil, err
	}
	synced := false
	defer func() { freeSynced(dev, buf, synced, s) }()
	mine := make([]float32, words*n)
	for i, v := range values {
		m, exp := math.Frexp(v)
		hi := float32(m)
		mine[words*i], mine[words*i+1], mine[words*i+2] = hi, float32(m-float64(hi)), float32(exp)
	}
	part := buf.slice(rank*words*n, words*n)
	all := make([]float32, buf.count)
	err = dev.copy(s, part, Float32s(mine))
	if err == nil {
		err = comm.AllGather(s, part, buf)
	}
	if err == nil {
		err = dev.copy(s, Float32s(all), buf)
	}
	if err == nil {
		err = s.Sync()
	}
	if err != nil {
		return nil, err
	}
	synced = true
	out := make([]float64, n)
	for i := range out {
		for r := range world {
			w := all[(r*n+i)*words:]
			v := math.Ldexp(float64(w[0])+float64(w[1]), int(w[2]))
			switch {
			case r == 0:
				out[i] = v
			case op == OpMax:
				out[i] = math.Max(out[i], v)
			default:
				out[i] += v
			}
		}
		if op == OpAvg {
			out[i] /= float64(world)
		}
	}
	return out, nil
}
