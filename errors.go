package zero

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error the package returns wraps one of them, so
// callers can test with errors.Is; the message says what to change. The
// README's table of errors says, for each, what causes it, whether the
// engine can go on, and what to do.
var (
	ErrConfig        = errors.New("zero: invalid config")
	ErrParam         = errors.New("zero: invalid parameter")
	ErrDType         = errors.New("zero: dtype mismatch")
	ErrGradSize      = errors.New("zero: gradient size mismatch")
	ErrDuplicateGrad = errors.New("zero: gradient reported twice in one backward")
	ErrPlanMismatch  = errors.New("zero: plans or settings differ between ranks")
	ErrProtocol      = errors.New("zero: call out of order")
	ErrStream        = errors.New("zero: unusable stream")
	// ErrCollective marks a fatal failure: a collective, a device operation
	// or a peer failed while the engine worked, and the engine cannot go
	// on. The error also wraps its cause (ErrTimeout, ErrCollectiveMismatch,
	// ErrPeerFailed, ErrCUDA, a caller's own error, …), which errors.Is
	// finds too.
	ErrCollective = errors.New("zero: the engine failed")
	ErrTimeout    = errors.New("zero: collective timed out")
	ErrPeerFailed = errors.New("zero: a peer rank failed or left")
	// ErrCollectiveMismatch: ranks called different collectives, or the
	// same ones with different sizes, dtypes or counts of backwards.
	ErrCollectiveMismatch = errors.New("zero: ranks called different collectives")
	// ErrMismatch is the old name of ErrCollectiveMismatch, the same value.
	//
	// Deprecated: use ErrCollectiveMismatch (ErrPlanMismatch is the
	// other mismatch: plans or settings); ErrMismatch goes at the next
	// release.
	ErrMismatch    = ErrCollectiveMismatch
	ErrClosed      = errors.New("zero: engine or communicator is closed")
	ErrAborted     = errors.New("zero: aborted")
	ErrOutOfMemory = errors.New("zero: out of memory")
	ErrNoCUDA      = errors.New("zero: CUDA not available")
	ErrCUDA        = errors.New("zero: CUDA error")
	ErrNCCL        = errors.New("zero: NCCL error")
	// ErrMPI: an MPI library that is missing or unusable, or a failed MPI
	// call (*MPIError, with MPI's own words).
	ErrMPI    = errors.New("zero: MPI error")
	ErrDevice = errors.New("zero: no such device")
	// ErrCheckpoint: a checkpoint could not be written, or is missing,
	// incomplete, damaged, of a newer format or of another model; the
	// message names the file and what to do.
	ErrCheckpoint = errors.New("zero: checkpoint")
)

func errorf(kind error, format string, args ...any) error {
	return fmt.Errorf("%w: %s", kind, fmt.Sprintf(format, args...))
}

// failure is a fatal error: it wraps ErrCollective, its cause, and the
// kinds that say where the cause came from (ErrStream for a caller's
// stream that failed, ErrAborted after an Abort), so that errors.Is finds
// each of them.
type failure struct {
	cause error
	kinds []error
}

func (f *failure) Error() string {
	return fmt.Sprintf("%v; the engine cannot go on: Close it (and build a new one to continue)", f.cause)
}

func (f *failure) Unwrap() []error { return append([]error{ErrCollective, f.cause}, f.kinds...) }
