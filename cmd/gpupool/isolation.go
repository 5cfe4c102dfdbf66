package main

import (
	"fmt"
	"io"
	"maps"
	"slices"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// printLeaseAndIsolation prints a lease, then what its processes run in
// on each of its hosts.
func printLeaseAndIsolation(w io.Writer, resp *gpupoolv1.GetLeaseResponse) error {
	if err := printLease(w, resp.GetLease()); err != nil {
		return err
	}
	iso := resp.GetHostIsolation()
	for _, host := range slices.Sorted(maps.Keys(iso)) {
		what := iso[host]
		if what == "" {
			what = "unknown (the agent predates lease sandboxes: processes run as its user)"
		}
		if _, err := fmt.Fprintf(w, "PROCESSES ON %s: %s\n", host, what); err != nil {
			return err
		}
	}
	return nil
}
