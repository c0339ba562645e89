package deepspeed

import (
	"errors"
	"fmt"
)

// The kinds of error the reader returns; every error it returns wraps one
// of them in an *Error that names the file, so errors.Is tells them apart
// and the message says what to change.
var (
	// ErrFormat: the bytes are not what the file claims to be (a truncated
	// or damaged zip, a malformed pickle, a tensor outside its storage, a
	// storage whose declared size is not its entry's).
	ErrFormat = errors.New("malformed file")
	// ErrUnsafe: the pickle asks for something the reader never does: a
	// class outside the allow-list, an opcode that imports or calls by
	// other means. Nothing of it was built.
	ErrUnsafe = errors.New("refused pickle content")
	// ErrLegacy: a PyTorch file in the pre-1.6 format (a bare pickle, not
	// a zip), refused before any unpickling.
	ErrLegacy = errors.New("legacy PyTorch file")
	// ErrUnsupported: a valid DeepSpeed checkpoint that zero cannot
	// continue (tensor or pipeline parallelism, an optimizer zero lacks,
	// a layout not read yet).
	ErrUnsupported = errors.New("cannot be continued in zero")
	// ErrInconsistent: the files of one checkpoint disagree with each
	// other or with their names (a missing rank, a file not what its name
	// says, shapes that do not add up to the partitions).
	ErrInconsistent = errors.New("inconsistent checkpoint")
)

// Error is an error of the reader: Kind is one of the Err values above,
// File the file it is about (or the directory).
type Error struct {
	Kind error
	File string
	Msg  string
}

func (e *Error) Error() string {
	if e.File == "" {
		return fmt.Sprintf("deepspeed: %v: %s", e.Kind, e.Msg)
	}
	return fmt.Sprintf("deepspeed: %s: %v: %s", e.File, e.Kind, e.Msg)
}

func (e *Error) Unwrap() error { return e.Kind }

func errorf(kind error, file, format string, args ...any) error {
	return &Error{Kind: kind, File: file, Msg: fmt.Sprintf(format, args...)}
}

// inFile gives err the file's name if it has none yet.
func inFile(err error, file string) error {
	var e *Error
	if errors.As(err, &e) && e.File == "" {
		c := *e
		c.File = file
		return &c
	}
	return err
}
