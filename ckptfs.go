package zero

import (
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

func (osFS) Open(name string) (ckptFile, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	// a load reads each file front to back: a longer readahead (a hint;
	// where it is refused the reads are the same)
	unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_SEQUENTIAL)
	return osFile{f}, nil
}

func (osFS) OpenWrite(name string) (ckptFile, error) {
	f, err := os.OpenFile(name, os.O_WRONLY, 0)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

func (osFS) ReadFile(name string) ([]byte, error)      { return os.ReadFile(name) }
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
