// Package loopfs gives tests a small file system of their own, to fill:
// an ext4 image in the test's temp dir, mounted through a loop device.
// It needs root, mkfs.ext4 and loop devices; a test without them skips,
// saying which is missing.
package loopfs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
)

// Mount makes a file system of sizeMiB, mounts it and returns its mount
// point; it is unmounted when the test ends.
func Mount(t testing.TB, sizeMiB int) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("a full disk needs a loop-mounted file system: run as root (mount -o loop)")
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("a full disk needs mkfs.ext4 (Debian e2fsprogs)")
	}
	dir := t.TempDir()
	img, mnt := filepath.Join(dir, "disk.img"), filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, int64(sizeMiB)<<20); err != nil {
		f, cerr := os.Create(img)
		if cerr != nil {
			t.Fatal(cerr)
		}
		f.Close()
		if err := os.Truncate(img, int64(sizeMiB)<<20); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m", "0", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v\n%s", err, out)
	}
	if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		t.Skipf("a full disk needs loop devices: mount -o loop: %v: %s", err, bytes.TrimSpace(out))
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			// A process of the test may still hold a file: lazily.
			if out2, err2 := exec.Command("umount", "-l", mnt).CombinedOutput(); err2 != nil {
				t.Errorf("umount %s: %v %s; %v %s", mnt, err, out, err2, out2)
			}
		}
	})
	return mnt
}

// Fill writes a file at path until the file system is full, and returns
// how many bytes it wrote.
func Fill(path string) (int64, error) {
	f, err := os.Create(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	chunk := make([]byte, 1<<20)
	var n int64
	for {
		w, err := f.Write(chunk)
		n += int64(w)
		if errors.Is(err, syscall.ENOSPC) {
			// The last blocks go to smaller writes.
			for len(chunk) > 512 {
				chunk = chunk[:len(chunk)/2]
				for {
					w, err := f.Write(chunk)
					n += int64(w)
					if err != nil {
						break
					}
				}
			}
			_ = f.Sync() // what fitted is written; a full disk may refuse the flush
			return n, nil
		}
		if err != nil {
			return n, fmt.Errorf("filling %s: %w", path, err)
		}
	}
}
