package zero

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// The file layer checkpoints go through: the operating system's, or in
// tests one that fails (and stops, as a crashed process would) at a chosen
// operation, so every write, fsync and rename of a save is a crash point.

// ckptFS is the few file operations a checkpoint needs.
type ckptFS interface {
	MkdirAll(dir string) error
	Create(name string) (ckptFile, error) // truncates
	// CreateNew creates name, failing with fs.ErrExist if it exists (a
	// save's lock).
	CreateNew(name string) (ckptFile, error)
	Open(name string) (ckptFile, error)
	// OpenWrite opens an existing file to write at offsets (an export's
	// file, which every rank writes its own ranges of).
	OpenWrite(name string) (ckptFile, error)
	ReadFile(name string) ([]byte, error)
	Rename(from, to string) error
	RemoveAll(name string) error
	ReadDir(dir string) ([]fs.DirEntry, error)
	// SyncDir makes the directory's entries (creations, renames) durable.
	SyncDir(dir string) error
}

// ckptFile is an open checkpoint file.
type ckptFile interface {
	io.Writer
	io.ReaderAt
	io.WriterAt
	Truncate(size int64) error
	Sync() error
	Close() error
	Size() (int64, error)
}

// osFS is the operating system's file layer.
type osFS struct{}

func (osFS) MkdirAll(dir string) error { return os.MkdirAll(dir, 0o755) }

func (osFS) Create(name string) (ckptFile, error) {
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

func (osFS) CreateNew(name string) (ckptFile, error) {
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

func (osFS) Open(name string) (ckptFile, error) {
	f, _, err := openRegular(name)
	if err != nil {
		return nil, err
	}
	// a load reads each file front to back: a longer readahead (a hint;
	// where it is refused the reads are the same)
	unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_SEQUENTIAL)
	return osFile{f}, nil
}

// errNotRegular is a checkpoint's file that is not a regular file.
var errNotRegular = errors.New("not a regular file")

// openRegular opens name to read, refusing anything but a regular file
// before a byte is read: the open does not block (a FIFO's would wait for
// a writer, and Abort could not end it), and the handle's fstat, not the
// name's, decides, so a symlink to /dev/zero is refused too. It returns the
// size the reads are limited to.
func openRegular(name string) (*os.File, int64, error) {
	fd, err := unix.Open(name, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, &fs.PathError{Op: "open", Path: name, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, 0, &fs.PathError{Op: "fstat", Path: name, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, 0, &fs.PathError{Op: "open", Path: name, Err: fmt.Errorf("%w (%s)", errNotRegular, fileKind(st.Mode))}
	}
	// O_NONBLOCK means nothing to a regular file's reads; cleared anyway
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return nil, 0, &fs.PathError{Op: "fcntl", Path: name, Err: err}
	}
	return os.NewFile(uintptr(fd), name), st.Size, nil
}

func fileKind(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFIFO:
		return "a FIFO"
	case unix.S_IFCHR:
		return "a character device"
	case unix.S_IFBLK:
		return "a block device"
	case unix.S_IFDIR:
		return "a directory"
	case unix.S_IFSOCK:
		return "a socket"
	}
	return fmt.Sprintf("file type %#o", mode&unix.S_IFMT)
}

// readRegular reads a regular file whole, at most the size its fstat gave
// (a file that grows meanwhile is read as it was).
func readRegular(name string) ([]byte, error) {
	f, size, err := openRegular(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, size)
	n, err := io.ReadFull(f, b)
	if err == io.ErrUnexpectedEOF { // it shrank
		err = nil
	}
	return b[:n], err
}

func (osFS) OpenWrite(name string) (ckptFile, error) {
	f, err := os.OpenFile(name, os.O_WRONLY, 0)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

func (osFS) ReadFile(name string) ([]byte, error)      { return readRegular(name) }
func (osFS) Rename(from, to string) error              { return os.Rename(from, to) }
func (osFS) RemoveAll(name string) error               { return os.RemoveAll(name) }
func (osFS) ReadDir(dir string) ([]fs.DirEntry, error) { return os.ReadDir(dir) }

func (osFS) SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

type osFile struct{ *os.File }

func (f osFile) Size() (int64, error) {
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return st.Size(), nil
}

// writeFileDurably writes data to name through a temporary name: the
// content is fsynced, renamed into place and the directory fsynced, so
// name holds either its old content or all of data, never part of it.
func writeFileDurably(fsys ckptFS, name string, data []byte) error {
	tmp := name + ".tmp"
	f, err := fsys.Create(tmp)
	if err != nil {
		return err
	}
	if _, err = f.Write(data); err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := fsys.Rename(tmp, name); err != nil {
		return err
	}
	return fsys.SyncDir(filepath.Dir(name))
}
