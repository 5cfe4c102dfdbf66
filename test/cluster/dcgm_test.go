package cluster_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestDCGMJobMappingFilesFollowLeasesAndAMissingDirectoryIsReportedOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 0)
	jobDir := filepath.Join(cl.dir, "dcgm-jobs")
	if err := os.Mkdir(jobDir, 0o755); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(cl.dir, "no-such-dir")
	cl.agents = append(cl.agents, cl.newAgent(0, "--dcgm-job-mapping-dir", jobDir), cl.newAgent(1, "--dcgm-job-mapping-dir", missing))
	for _, p := range cl.agents {
		p.start(t)
	}
	cl.waitForHosts(2)

	// The files name each GPU's leases, by GPU index.
	mapping := func() map[string]string {
		out := map[string]string{}
		ents, err := os.ReadDir(jobDir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			b, _ := os.ReadFile(filepath.Join(jobDir, e.Name()))
			out[e.Name()] = string(b)
		}
		return out
	}
	leaseIndex := func(id string) string {
		l := cl.getLease(id)
		return fmt.Sprint(l.Slices[0].DeviceIndex)
	}
	l1, l2 := cl.acquireOnHost(t, "host-1"), cl.acquireOnHost(t, "host-1")
	eventually(t, "both leases in the mapping", 30*time.Second, func() error {
		m := mapping()
		for _, id := range []string{l1, l2} {
			if !strings.Contains(m[leaseIndex(id)], id+"\n") {
				return fmt.Errorf("%s not in file %s: files %q", id, leaseIndex(id), m)
			}
		}
		return nil
	})
	for _, id := range []string{l1, l2} {
		if _, err := cl.c.Lease.Release(ctxFor(t, 30*time.Second), &gpupoolv1.ReleaseRequest{LeaseId: id}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "the mapping emptied by the teardowns", 30*time.Second, func() error {
		if m := mapping(); len(m) != 0 {
			return fmt.Errorf("files left: %q", m)
		}
		return nil
	})

	// host-2's directory is missing: reported once, and the leases are
	// enforced all the same.
	l3, l4 := cl.acquireOnHost(t, "host-2"), cl.acquireOnHost(t, "host-2")
	eventually(t, "host-2 enforcing both leases", 30*time.Second, func() error {
		log, _ := os.ReadFile(cl.agents[1].log.Name())
		for _, id := range []string{l3, l4} {
			if !strings.Contains(string(log), "enforcing lease") || !strings.Contains(string(log), id) {
				return fmt.Errorf("its log does not say it enforces %s", id)
			}
		}
		return nil
	})
	log, _ := os.ReadFile(cl.agents[1].log.Name())
	if n := strings.Count(string(log), "cannot write the DCGM job mapping"); n != 1 || !strings.Contains(string(log), missing) {
		t.Errorf("host-2 reported the missing directory %d times (want once, naming %s)", n, missing)
	}
}
