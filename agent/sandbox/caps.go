package sandbox

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The securebits of linux/securebits.h, which x/sys/unix does not name.
const (
	secbitNoroot                  = 1 << 0
	secbitNorootLocked            = 1 << 1
	secbitNoSetuidFixupLocked     = 1 << 3
	secbitKeepCapsLocked          = 1 << 5
	secbitNoCapAmbientRaise       = 1 << 6
	secbitNoCapAmbientRaiseLocked = 1 << 7
)

// leaseSecurebits keep a lease from ever holding a capability again:
// root gets none from exec (NOROOT), a change of uid away from root
// drops them (the setuid fixup, locked on), the keep-caps escape is
// locked off, and the ambient set stays empty. All are locked, so not
// even the init's own root could undo them in the lease.
const leaseSecurebits = secbitNoroot | secbitNorootLocked |
	secbitNoSetuidFixupLocked | secbitKeepCapsLocked |
	secbitNoCapAmbientRaise | secbitNoCapAmbientRaiseLocked

// dropCapabilities makes the calling thread's future children unable to
// hold any capability: it sets leaseSecurebits, clears the ambient and
// inheritable sets and empties the bounding set. The thread keeps its own
// effective and permitted sets (the init still needs CAP_SETUID and
// CAP_SETGID to become the lease's user in the forked child), which the
// child loses with its change to a non-root uid and cannot regain on exec.
//
// All of it is per thread: call it on the locked thread that forks the
// workload.
func dropCapabilities() error {
	if err := unix.Prctl(unix.PR_SET_SECUREBITS, leaseSecurebits, 0, 0, 0); err != nil {
		return fmt.Errorf("setting the securebits: %w", err)
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clearing the ambient capabilities: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("reading the capabilities: %w", err)
	}
	data[0].Inheritable, data[1].Inheritable = 0, 0
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("clearing the inheritable capabilities: %w", err)
	}
	last, err := lastCap()
	if err != nil {
		return err
	}
	for c := 0; c <= last; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			return fmt.Errorf("dropping capability %d from the bounding set: %w", c, err)
		}
	}
	return nil
}

// lastCap is the highest capability the running kernel knows, which may
// differ from the one x/sys/unix was generated with (dropping one the
// kernel does not know fails).
func lastCap() (int, error) {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 0, fmt.Errorf("finding the kernel's last capability: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 || n > 63 {
		return 0, fmt.Errorf("/proc/sys/kernel/cap_last_cap: %q: want a number of 0 to 63", b)
	}
	return n, nil
}
