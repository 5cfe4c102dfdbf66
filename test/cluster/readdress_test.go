package cluster_test

import (
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// setFlag replaces the value after flag in args.
func setFlag(t *testing.T, args []string, flag, value string) {
	t.Helper()
	i := slices.Index(args, flag)
	if i < 0 || i+1 >= len(args) {
		t.Fatalf("no %s in %q", flag, args)
	}
	args[i+1] = value
}

// A rolling update recreates each broker pod with a new IP: every broker
// restarts once, on its data dir, with a new Raft address (and with a new
// gRPC address too when the IP changes). Each moved broker gets the Raft
// configuration updated, so the cluster keeps a leader and its state.
func TestBrokersMovedOneAtATimeKeepALeaderAndTheirLeases(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	tests := []struct {
		name  string
		newIP bool // else: only the Raft port changes
	}{
		{"new raft port on the same IP", false},
		{"new IP for gRPC and Raft", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var opts []clusterOption
			if tt.newIP {
				// With TLS: the brokers verify each other by role, not by
				// address, so a moved broker needs no new certificate.
				opts = append(opts, withTLS)
			}
			cl := newCluster(t, 1, opts...)
			cur := slices.Clone(cl.addrs) // gRPC addresses now
			var newRPC, newRaft []string
			for i := range cl.brokers {
				ip := fmt.Sprintf("127.0.0.%d", i+2)
				rpc := cl.addrs[i]
				if tt.newIP {
					ip = fmt.Sprintf("127.0.0.%d", i+12)
					rpc = freePort(t, ip)
				}
				newRPC = append(newRPC, rpc)
				newRaft = append(newRaft, freePort(t, ip))
			}
			if tt.newIP {
				// Clients and the agent know every address a broker will
				// have, as a DNS name would follow the pods.
				all := append(slices.Clone(cl.addrs), newRPC...)
				cl.c = cl.dial(all...)
				cl.agents[0].signal(t, syscall.SIGTERM)
				cl.agents[0] = cl.newAgent(0, "--broker", strings.Join(all, ","))
				cl.agents[0].start(t)
				cl.waitForHosts(1)
			}

			before, err := cl.c.Lease.Acquire(ctxFor(t, 30*time.Second), fractional(4096, 10, "before-moves"))
			if err != nil {
				t.Fatal(err)
			}

			for i, b := range cl.brokers {
				id := fmt.Sprintf("broker-%d", i+1)
				b.signal(t, syscall.SIGTERM)
				cur[i] = newRPC[i]
				var join []string
				for j, a := range cur {
					if j != i {
						join = append(join, a)
					}
				}
				setFlag(t, b.args, "--bind", newRPC[i])
				setFlag(t, b.args, "--raft-bind", newRaft[i])
				setFlag(t, b.args, "--join", strings.Join(join, ","))
				b.start(t)
				// Every broker's own configuration lists the moved one as a
				// voter at its new address, and knows a leader.
				for j, addr := range cur {
					direct := cl.dial(addr)
					eventually(t, fmt.Sprintf("broker-%d to see %s at %s", j+1, id, newRaft[i]), 60*time.Second, func() error {
						resp, err := direct.Operator.RaftPeers(ctxFor(t, 5*time.Second), &gpupoolv1.RaftPeersRequest{})
						if err != nil {
							return err
						}
						if resp.LeaderId == "" {
							return fmt.Errorf("no leader")
						}
						for _, p := range resp.Peers {
							if p.Id == id {
								if p.RaftAddress != newRaft[i] || !p.Voter || p.RpcAddress != newRPC[i] {
									return fmt.Errorf("%s is at raft %s rpc %s, voter=%v", id, p.RaftAddress, p.RpcAddress, p.Voter)
								}
								return nil
							}
						}
						return fmt.Errorf("%s is not a peer", id)
					})
					direct.Close()
				}
				t.Logf("%s moved to raft %s, rpc %s", id, newRaft[i], newRPC[i])
			}

			// operator raft peers shows the new addresses and a leader.
			addr := "--addr=" + strings.Join(cur, ",")
			eventually(t, "raft peers to show a leader", 30*time.Second, func() error {
				out, stderr, code := gpupool(t, append([]string{"operator", "raft", "peers", addr}, cl.clientFlags()...)...)
				if code != 0 {
					return fmt.Errorf("exit %d: %s", code, stderr)
				}
				for _, a := range newRaft {
					if !strings.Contains(out, a) {
						return fmt.Errorf("output lacks %s:\n%s", a, out)
					}
				}
				if !strings.Contains(out, "leader") {
					return fmt.Errorf("output shows no leader:\n%s", out)
				}
				return nil
			})
			cl.leader()

			// The lease from before the moves is still there, and a new
			// acquire works.
			got, err := cl.c.Lease.Get(ctxFor(t, 30*time.Second), &gpupoolv1.GetLeaseRequest{LeaseId: before.Lease.Id})
			if err != nil {
				t.Fatal(err)
			}
			if got.Lease.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || got.Lease.FencingToken != before.Lease.FencingToken {
				t.Fatalf("lease %s after the moves: %v fencing %d, want GRANTED fencing %d", before.Lease.Id, got.Lease.State, got.Lease.FencingToken, before.Lease.FencingToken)
			}
			eventually(t, "an acquire after the moves", 30*time.Second, func() error {
				_, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), fractional(4096, 10, "after-moves"))
				return err
			})
		})
	}
}
