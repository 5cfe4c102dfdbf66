package agent

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Listens reports whether a process of the lease listens on TCP port of
// the pool host's loopback (or of every address): forward reaches only
// those. It reads the listening sockets from /proc/net/tcp and tcp6 and
// looks for one of their inodes among the open files of the lease's
// processes.
func (a *Agent) Listens(leaseID string, port int) bool {
	if _, ok := a.leases.get(leaseID); !ok {
		return false
	}
	inodes := map[string]bool{}
	for _, f := range []string{"net/tcp", "net/tcp6"} {
		b, err := os.ReadFile(filepath.Join(a.cfg.ProcRoot, f))
		if err == nil {
			listeningInodes(b, port, inodes)
		}
	}
	if len(inodes) == 0 {
		return false
	}
	procs, err := a.procs.Scan()
	if err != nil {
		return false
	}
	for _, p := range procs[leaseID] {
		fdDir := filepath.Join(a.cfg.ProcRoot, strconv.Itoa(p.PID), "fd")
		fds, err := os.ReadDir(fdDir)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			link, err := os.Readlink(filepath.Join(fdDir, fd.Name()))
			if err != nil {
				continue
			}
			if ino, ok := strings.CutPrefix(link, "socket:["); ok && inodes[strings.TrimSuffix(ino, "]")] {
				return true
			}
		}
	}
	return false
}

// listeningInodes adds to inodes the socket inodes of a /proc/net/tcp{,6}
// table that listen (state 0A) on port, on a loopback or any address.
func listeningInodes(table []byte, port int, inodes map[string]bool) {
	wantPort := fmt.Sprintf("%04X", port)
	sc := bufio.NewScanner(bytes.NewReader(table))
	sc.Scan() // the header
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
		if len(f) < 10 || f[3] != "0A" {
			continue
		}
		addr, p, ok := strings.Cut(f[1], ":")
		if !ok || p != wantPort || !loopbackOrAny(addr) {
			continue
		}
		inodes[f[9]] = true
	}
}

// loopbackOrAny reports whether a /proc/net/tcp address (hex, in the
// kernel's byte order) is 127.0.0.0/8, ::1, a v4-mapped loopback, or the
// any address.
func loopbackOrAny(hex string) bool {
	switch len(hex) {
	case 8: // IPv4, little-endian on the hosts we run on: 0100007F is 127.0.0.1
		return hex == "00000000" || strings.HasSuffix(hex, "7F")
	case 32:
		return hex == strings.Repeat("0", 32) || hex == "00000000000000000000000001000000" ||
			(strings.HasPrefix(hex, "0000000000000000FFFF0000") && strings.HasSuffix(hex, "7F"))
	}
	return false
}
