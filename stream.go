package zero

import (
	"sync"
	"sync/atomic"
	"time"
)

// Stream is an ordered queue of work on a device, with CUDA's semantics:
// work runs in the order it was enqueued; Wait makes later work wait for
// an event recorded on any stream; Sync blocks the caller until the stream
// is idle and returns the first error the stream met (errors are sticky).
type Stream interface {
	// Record enqueues a marker and returns the event that fires when the
	// stream's work enqueued so far has completed.
	Record() (Event, error)
	// Wait makes work enqueued on this stream after the call wait for e.
	// A nil event is a no-op, as for an event that was never recorded.
	Wait(e Event) error
	// Sync waits until all work enqueued so far has completed.
	Sync() error
	// Close waits for the queue to drain and releases the stream.
	Close() error
}

// Event marks a point in a stream's work.
type Event interface {
	// Sync blocks until the event has fired and returns the error, if any,
	// of the work before it.
	Sync() error
	// Done reports whether the event has fired, without blocking.
	Done() bool
}

// Elapsed returns the time between two fired events of one device.
func Elapsed(start, end Event) (time.Duration, error) {
	type timed interface {
		elapsedSince(Event) (time.Duration, error)
	}
	if t, ok := end.(timed); ok {
		return t.elapsedSince(start)
	}
	return 0, errorf(ErrStream, "Elapsed: events of different devices")
}

// HostStream is the CPU twin of a CUDA stream: one goroutine runs its queue.
type HostStream struct {
	mu     sync.Mutex
	wake   *sync.Cond
	queue  []hostOp
	err    error // sticky: the first error a work item returned
	closed bool
	exited chan struct{}

	// For tests that must know the stream cannot move on by itself.
	idle      bool                      // the worker waits for work
	blockedOn atomic.Pointer[hostEvent] // the event a Wait is blocked on
}

type hostOp struct {
	fn      func() error
	control bool // runs even after an error: events, waits, markers
}

// NewHostStream starts a stream on the host.
func NewHostStream() *HostStream {
	s := &HostStream{exited: make(chan struct{})}
	s.wake = sync.NewCond(&s.mu)
	go s.run()
	return s
}

func (s *HostStream) run() {
	defer close(s.exited)
	for {
		s.mu.Lock()
		for len(s.queue) == 0 && !s.closed {
			s.idle = true
			s.wake.Wait()
		}
		s.idle = false
		if len(s.queue) == 0 {
			s.mu.Unlock()
			return
		}
		op := s.queue[0]
		s.queue[0] = hostOp{}
		s.queue = s.queue[1:]
		failed := s.err != nil
		s.mu.Unlock()
		if failed && !op.control {
			continue
		}
		if err := op.fn(); err != nil {
			s.fail(err)
		}
	}
}

func (s *HostStream) fail(err error) {
	s.mu.Lock()
	if s.err == nil {
		s.err = err
	}
	s.mu.Unlock()
}

func (s *HostStream) stickyErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

func (s *HostStream) enqueue(op hostOp) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errorf(ErrClosed, "enqueue on a closed stream")
	}
	s.queue = append(s.queue, op)
	s.wake.Signal()
	return nil
}

// Launch enqueues host work. It is skipped once the stream has failed; an
// error it returns makes the stream fail.
func (s *HostStream) Launch(fn func() error) error {
	return s.enqueue(hostOp{fn: fn})
}

type hostEvent struct {
	fired chan struct{}
	err   error
	at    time.Time
}

// hostSyncsBlocked counts the event Syncs that had to wait, for tests that
// must know a caller is waiting.
var hostSyncsBlocked atomic.Int64

// Record enqueues a marker; its event fires when the work before it has run.
func (s *HostStream) Record() (Event, error) {
	e := &hostEvent{fired: make(chan struct{})}
	err := s.enqueue(hostOp{control: true, fn: func() error {
		e.err = s.stickyErr()
		e.at = time.Now()
		close(e.fired)
		return nil
	}})
	if err != nil {
		return nil, err
	}
	return e, nil
}

// Wait makes the stream's later work wait for e, an event of a host stream.
func (s *HostStream) Wait(e Event) error {
	if e == nil {
		return nil
	}
	he, ok := e.(*hostEvent)
	if !ok {
		return errorf(ErrStream, "a host stream cannot wait on a %T; use events of the host device", e)
	}
	// A failed producer fails the waiter too, so errors travel along
	// dependencies instead of being read as good data.
	return s.enqueue(hostOp{control: true, fn: func() error {
		if !he.Done() {
			s.blockedOn.Store(he)
			<-he.fired
			s.blockedOn.Store(nil)
		}
		return he.err
	}})
}

// settled reports whether the stream cannot move on by itself: it has no
// work left, or it is blocked on an event that has not fired.
func (s *HostStream) settled() bool {
	if he := s.blockedOn.Load(); he != nil && !he.Done() {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queue) == 0 && s.idle
}

// Sync blocks until the work enqueued so far has run, and returns the
// stream's first error.
func (s *HostStream) Sync() error {
	e, err := s.Record()
	if err != nil {
		return err
	}
	return e.Sync()
}

// Close drains the queue, stops the stream and returns its error. Closing
// a closed stream does nothing.
func (s *HostStream) Close() error {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil
	}
	err := s.Sync()
	s.mu.Lock()
	s.closed = true
	s.wake.Signal()
	s.mu.Unlock()
	<-s.exited
	return err
}

func (e *hostEvent) Sync() error {
	if !e.Done() {
		hostSyncsBlocked.Add(1)
		<-e.fired
	}
	return e.err
}

func (e *hostEvent) Done() bool {
	select {
	case <-e.fired:
		return true
	default:
		return false
	}
}

func (e *hostEvent) elapsedSince(start Event) (time.Duration, error) {
	se, ok := start.(*hostEvent)
	if !ok {
		return 0, errorf(ErrStream, "Elapsed: events of different devices")
	}
	if err := se.Sync(); err != nil {
		return 0, err
	}
	if err := e.Sync(); err != nil {
		return 0, err
	}
	return e.at.Sub(se.at), nil
}
