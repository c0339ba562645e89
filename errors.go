package zero

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error the package returns wraps one of them, so
// callers can test with errors.Is; the message says what to change.
var (
	ErrConfig        = errors.New("zero: invalid config")
	ErrParam         = errors.New("zero: invalid parameter")
	ErrDType         = errors.New("zero: dtype mismatch")
	ErrGradSize      = errors.New("zero: gradient size mismatch")
	ErrDuplicateGrad = errors.New("zero: gradient reported twice in one backward")
	ErrPlanMismatch  = errors.New("zero: partition plans differ between ranks")
	ErrProtocol      = errors.New("zero: call out of order")
	ErrStream        = errors.New("zero: stream of the wrong device")
	ErrCollective    = errors.New("zero: collective failed")
	ErrTimeout       = errors.New("zero: collective timed out")
	ErrPeerFailed    = errors.New("zero: a peer rank failed or left")
	ErrMismatch      = errors.New("zero: ranks called different collectives")
	ErrClosed        = errors.New("zero: engine or communicator is closed")
	ErrNoCUDA        = errors.New("zero: CUDA not available")
	ErrCUDA          = errors.New("zero: CUDA error")
	ErrNCCL          = errors.New("zero: NCCL error")
	ErrDevice        = errors.New("zero: no such device")
)

func errorf(kind error, format string, args ...any) error {
	return fmt.Errorf("%w: %s", kind, fmt.Sprintf(format, args...))
}
