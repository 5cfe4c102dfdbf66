// Package atomicfile replaces files so that a crash leaves either the old
// or the new content, never a mix.
package atomicfile

import (
	"io/fs"
	"os"
	"path/filepath"
)

// Write replaces path with data (mode 0600): it writes a temporary file in
// the same directory, syncs it, renames it over path and syncs the
// directory. On error the temporary file is removed and path is untouched.
func Write(path string, data []byte) error {
	return WriteMode(path, data, 0o600)
}

// WriteMode is Write with the file's permission bits perm, for files that
// other users must read.
func WriteMode(path string, data []byte, perm fs.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		os.Remove(f.Name())
		return err
	}
	return Commit(osDir{}, f, f.Name(), path, perm)
}

// Dir is the file system Commit renames in: an *os.Root, whose names are
// relative to it, or the process's own.
type Dir interface {
	Open(name string) (*os.File, error)
	Rename(oldname, newname string) error
	Remove(name string) error
}

// osDir is the process's file system as a Dir.
type osDir struct{}

func (osDir) Open(name string) (*os.File, error)   { return os.Open(name) }
func (osDir) Rename(oldname, newname string) error { return os.Rename(oldname, newname) }
func (osDir) Remove(name string) error             { return os.Remove(name) }

// Commit makes the written temporary file f, named tmp in d, the file
// path of d: it sets f's permission bits to perm, syncs f, renames it over
// path and syncs the directory. It closes f. Unless the rename took place,
// tmp is removed and path is untouched.
func Commit(d Dir, f *os.File, tmp, path string, perm fs.FileMode) error {
	err := f.Chmod(perm)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = d.Rename(tmp, path)
	}
	if err != nil {
		d.Remove(tmp)
		return err
	}
	dir, err := d.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer dir.Close()
	return dir.Sync()
}
