package zero

import (
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"
)

// NewLocalGroup returns n communicators over host memory, one per rank,
// for n ranks driven by goroutines of one process. Collectives are
// deterministic: reductions combine ranks in rank order. Each rank does
// 1/n of every collective's work, so the group uses all cores.
func NewLocalGroup(n int) ([]Comm, error) {
	return NewLocalGroupTimeout(n, DefaultTimeout)
}

// NewLocalGroupTimeout is NewLocalGroup with a bound on how long a
// collective waits for a peer that failed or left.
func NewLocalGroupTimeout(n int, timeout time.Duration) ([]Comm, error) {
	if n < 1 {
		return nil, errorf(ErrConfig, "NewLocalGroup(%d): the world size must be at least 1", n)
	}
	if timeout <= 0 {
		return nil, errorf(ErrConfig, "NewLocalGroup: timeout %v; give a positive duration", timeout)
	}
	g := &localGroup{n: n, timeout: timeout, pending: map[uint64]*rendezvous{}, abortLatch: newAbortLatch()}
	comms := make([]Comm, n)
	for r := range comms {
		c := &localComm{g: g, rank: r}
		c.collectives = collectives{world: n, issue: c.enqueue}
		comms[r] = c
	}
	return comms, nil
}

type localGroup struct {
	n       int
	timeout time.Duration
	// beforeWork, for tests, runs before a rank's part of each collective:
	// a peer slow to finish it.
	beforeWork func(rank int)

	abortLatch                        // its mu also guards pending
	pending    map[uint64]*rendezvous // by collective sequence number
}

// rendezvous is one collective: the k-th collective of every rank meets
// the k-th of the others, whatever streams they run on.
type rendezvous struct {
	args     []collArgs
	came     []bool // per rank: arrived (what a timeout names)
	arrived  int
	departed int
	all      chan struct{} // every rank published its arguments
	done     chan struct{} // every rank finished its part
}

// meet counts rank in at one phase of collective seq and returns when
// every rank has, or, arriving, with an error when the group was aborted
// or a peer did not come within the timeout.
//
// A rank must never leave while a peer may still read its buffers. Once
// every rank has arrived (published its arguments), every rank does its
// part of the work and then departs, so the departure waits for all of
// them, abort or not, and however long their part takes: no timeout, since
// the part is this process's own copying and adding, which always ends (a
// timeout let a rank free a buffer a slow peer still copied from). An
// arrival that did not complete can never complete after an abort (no
// rank arrives once the group is aborted), so no peer does any work with
// this rank's buffers.
func (g *localGroup) meet(rank int, seq uint64, a *collArgs) (*rendezvous, error) {
	g.mu.Lock()
	if a != nil && g.reason != nil {
		g.mu.Unlock()
		return nil, g.reason
	}
	rv := g.pending[seq]
	if rv == nil {
		rv = &rendezvous{args: make([]collArgs, g.n), came: make([]bool, g.n), all: make(chan struct{}), done: make(chan struct{})}
		g.pending[seq] = rv
	}
	var ch chan struct{}
	if a != nil {
		rv.args[rank] = *a
		rv.came[rank] = true
		rv.arrived++
		ch = rv.all
		if rv.arrived == g.n {
			close(ch)
		}
	} else {
		rv.departed++
		ch = rv.done
		if rv.departed == g.n {
			close(ch)
			delete(g.pending, seq)
		}
	}
	g.mu.Unlock()
	if a == nil { // every peer that arrived departs: wait for them, abort or not
		<-ch
		return rv, nil
	}
	timer := time.NewTimer(g.timeout)
	defer timer.Stop()
	select {
	case <-ch:
		return rv, nil
	case <-g.aborted:
	case <-timer.C:
		if err := g.timedOut(rank, seq, rv); err != nil {
			g.abort(err)
		}
	}
	select {
	case <-ch: // the phase completed before the abort: the peers work on
		return rv, nil
	default:
		return nil, g.abortErr()
	}
}

// timedOut says what rank saw when collective seq timed out: which ranks
// did not come and which did; nil when every rank came as the timer fired.
func (g *localGroup) timedOut(rank int, seq uint64, rv *rendezvous) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	var missing, there []int
	for r, ok := range rv.came {
		if ok {
			there = append(there, r)
		} else {
			missing = append(missing, r)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	return errorf(ErrTimeout, "collective %d (%v on rank %d): %s did not arrive within %v (%s did); %s failed, returned early or issued fewer collectives",
		seq, rv.args[rank], rank, ranksText(missing), g.timeout, ranksText(there), ranksText(missing))
}

// ranksText names a set of ranks: "rank 1", "ranks 1 and 3", "ranks 1, 2 and 3".
func ranksText(rs []int) string {
	if len(rs) == 1 {
		return fmt.Sprint("rank ", rs[0])
	}
	s := "ranks "
	for i, r := range rs {
		switch {
		case i == 0:
		case i == len(rs)-1:
			s += " and "
		default:
			s += ", "
		}
		s += fmt.Sprint(r)
	}
	return s
}

// callsText says what each rank called: "rank 0 called X, rank 1 called Y".
func callsText(args []collArgs) string {
	s := ""
	for r, a := range args {
		if r > 0 {
			s += ", "
		}
		s += fmt.Sprintf("rank %d called %v", r, a)
	}
	return s
}

type localComm struct {
	g       *localGroup
	rank    int
	seq     uint64                // collectives issued by this rank
	closed  atomic.Bool           // this rank closed its communicator
	aborted atomic.Pointer[error] // why this rank aborted the group (AbortComm), if it did
	collectives
	counters
}

func (c *localComm) Rank() int      { return c.rank }
func (c *localComm) Size() int      { return c.g.n }
func (c *localComm) Device() Device { return hostDev }

func (c *localComm) Counters() CommCounters { return c.snapshot() }

func (c *localComm) Close() error {
	c.closed.Store(true)
	c.g.abort(errorf(ErrPeerFailed, "rank %d closed its communicator", c.rank))
	return nil
}

func (c *localComm) abort(reason error) {
	c.aborted.CompareAndSwap(nil, &reason)
	c.g.abort(fmt.Errorf("%w: %w", ErrPeerFailed, reason))
}

// ownErr is what this rank sees of a failed collective: ErrClosed once it
// closed its communicator itself, ErrAborted once it aborted the group
// itself; a peer's failure only where it was a peer's.
func (c *localComm) ownErr(err error) error {
	if err == nil {
		return nil
	}
	if c.closed.Load() {
		return errorf(ErrClosed, "rank %d closed its communicator", c.rank)
	}
	if reason := c.aborted.Load(); reason != nil {
		return fmt.Errorf("%w: rank %d aborted its group: %w", ErrAborted, c.rank, *reason)
	}
	return err
}

func (c *localComm) enqueue(s Stream, x collective) error {
	hs, err := hostStreamOf(s)
	if err != nil {
		return err
	}
	if err := c.g.abortErr(); err != nil {
		return c.ownErr(err)
	}
	c.add(x.kind, x.payload(), c.g.n)
	seq := c.seq
	c.seq++
	return hs.Launch(func() error {
		err := c.run(seq, x.args())
		keepAlive(x.send, x.recv)
		return c.ownErr(err)
	})
}

// run is one rank's part of a collective: publish the arguments, meet the
// peers, do this rank's 1/n of the work, and meet again so no rank reuses a
// buffer a peer still reads (that meeting waits for every peer, so no
// buffer of a returned collective is ever in a peer's use).
func (c *localComm) run(seq uint64, a collArgs) error {
	g := c.g
	rv, err := g.meet(c.rank, seq, &a)
	if err != nil {
		return err // no peer works with this rank's buffers (see meet)
	}
	for _, o := range rv.args {
		if o.kind != a.kind || o.op != a.op || o.root != a.root || o.dtype != a.dtype || o.count != a.count {
			err := errorf(ErrCollectiveMismatch, "collective %d: %s; every rank must issue the same collectives in the same order", seq, callsText(rv.args))
			g.abort(err)
			return err // every rank sees the mismatch: none works
		}
	}
	if g.beforeWork != nil {
		g.beforeWork(c.rank)
	}
	c.work(rv.args, a)
	_, err = g.meet(c.rank, seq, nil)
	return err
}

func (c *localComm) work(slots []collArgs, a collArgs) {
	n, r := c.g.n, c.rank
	size := uintptr(a.dtype.Size())
	switch a.kind {
	case KindAllReduce:
		bufs := make([]uintptr, n)
		for i, o := range slots {
			bufs[i] = o.send
		}
		lo, hi := splitRange(a.count, n, r)
		if hi > lo {
			allReduceFusedHost(bufs, a.dtype, a.op, lo, hi)
		}
	case KindReduceScatter:
		chunk := a.count / n
		srcs := make([]uintptr, n)
		for i, o := range slots {
			srcs[i] = o.send + uintptr(r*chunk)*size
		}
		reduceHost(a.recv, srcs, a.dtype, a.op, 0, chunk)
	case KindAllGather:
		for i, o := range slots {
			if part := a.recv + uintptr(i*a.count)*size; o.send != part {
				copyStream(part, o.send, a.count*int(size))
			}
		}
	case KindBroadcast:
		if r != a.root {
			copyStream(a.recv, slots[a.root].send, a.count*int(size))
		}
	}
}

// splitRange gives part r of n of [0, count), with inner boundaries on
// 64-element (cache line) multiples so ranks never share a line.
func splitRange(count, n, r int) (int, int) {
	per := (count/n + 63) &^ 63
	lo, hi := min(r*per, count), min((r+1)*per, count)
	if r == n-1 {
		hi = count
	}
	return lo, hi
}

// RunLocal runs fn on the n ranks of a new in-process group
// (NewLocalGroup), one goroutine each, and returns when every rank has
// returned: nil, or every failed rank's error joined ("rank r: …"); a
// rank's panic is ErrAborted with the panic's value and, once, the rank's
// stack. When a rank fails (or panics), RunLocal aborts the group, so that the other
// ranks' blocked and later collectives fail at once instead of at the
// group's timeout. Each rank's Comm is closed when its fn returns.
func RunLocal(n int, fn func(comm Comm) error) error {
	comms, err := NewLocalGroup(n)
	if err != nil {
		return err
	}
	return RunRanks(comms, fn)
}

// RunRanks is RunLocal over communicators the caller made (a group with its
// own timeout, the one-GPU group), one rank per element of comms.
func RunRanks(comms []Comm, fn func(comm Comm) error) error {
	if len(comms) == 0 {
		return errorf(ErrConfig, "RunRanks with no communicators; pass one per rank")
	}
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for r, comm := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer comm.Close()
			defer func() {
				var reason error // what the peers' errors say: a panic's stack only once, in this rank's
				if p := recover(); p != nil {
					errs[r] = fmt.Errorf("%w: panicked: %v\n%s", ErrAborted, p, debug.Stack())
					reason = fmt.Errorf("rank %d: %w: panicked: %v (its stack is in rank %d's error)", r, ErrAborted, p, r)
				}
				if errs[r] != nil {
					errs[r] = fmt.Errorf("rank %d: %w", r, errs[r])
					if reason == nil {
						reason = errs[r]
					}
					AbortComm(comm, reason)
				}
			}()
			errs[r] = fn(comm)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
