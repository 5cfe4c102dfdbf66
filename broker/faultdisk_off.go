//go:build !faultinject

package broker

import "github.com/hashicorp/raft"

// injectDiskFaults returns store as it is: only a build with -tags
// faultinject can slow its own disk (faultdisk.go).
func injectDiskFaults(_ string, store raft.LogStore, _ <-chan struct{}, _ func(func())) raft.LogStore {
	return store
}
