package leasebench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/gpupool/gpupool/internal/proc"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// etcdVersion is what `bin --version` says its version is.
func etcdVersion(ctx context.Context, bin string) (string, error) {
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("etcd binary: %w (bench/lease/install-etcd.sh installs Debian's etcd-server, or pass --etcd)", err)
	}
	out, err := exec.CommandContext(ctx, bin, "--version").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s --version: %v\n%s", bin, err, out)
	}
	for line := range strings.Lines(string(out)) {
		if v, ok := strings.CutPrefix(line, "etcd Version:"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("%s --version: no \"etcd Version:\" line in %q", bin, out)
}

// etcdCluster is three etcd members, as child processes, and a client of
// them.
type etcdCluster struct {
	children []*proc.Proc
	cli      *clientv3.Client
}

// startEtcd starts three members of bin on 127.0.0.5-7 with data dirs
// under dir and default durability (fsync on every WAL commit), and waits
// until each answers and the cluster takes a write.
func startEtcd(ctx context.Context, dir, bin string) (*etcdCluster, error) {
	clientAddrs, err := freeAddrs(5, 3)
	if err != nil {
		return nil, err
	}
	peerAddrs, err := freeAddrs(5, 3)
	if err != nil {
		return nil, err
	}
	var initial, endpoints []string
	for i, a := range peerAddrs {
		initial = append(initial, fmt.Sprintf("etcd-%d=http://%s", i+1, a))
		endpoints = append(endpoints, "http://"+clientAddrs[i])
	}
	cl := &etcdCluster{}
	for i := range clientAddrs {
		name := fmt.Sprintf("etcd-%d", i+1)
		c, err := startChild(dir, name, bin,
			"--name", name, "--data-dir", filepath.Join(dir, name),
			"--listen-client-urls", endpoints[i], "--advertise-client-urls", endpoints[i],
			"--listen-peer-urls", "http://"+peerAddrs[i], "--initial-advertise-peer-urls", "http://"+peerAddrs[i],
			"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-state", "new",
			"--initial-cluster-token", "gpupool-bench-lease-"+filepath.Base(dir),
			"--logger", "zap", "--log-level", "warn")
		if err != nil {
			cl.stop()
			return nil, err
		}
		cl.children = append(cl.children, c)
	}
	cl.cli, err = clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		cl.stop()
		return nil, fmt.Errorf("etcd client: %w", err)
	}
	err = proc.Poll(ctx, readyTimeout, func(ctx context.Context) error {
		if err := diedError(cl.children); err != nil {
			return proc.GiveUp{Err: errors.Join(errStopped, err)}
		}
		for _, ep := range endpoints {
			st, err := cl.cli.Status(ctx, ep)
			if err != nil {
				return fmt.Errorf("%s: %w", ep, err)
			}
			if st.Leader == 0 {
				return fmt.Errorf("%s: no leader yet", ep)
			}
		}
		_, err := cl.cli.Put(ctx, "/gpupool-bench/health", "ok")
		return err
	})
	if err != nil {
		cl.stop()
		return nil, fmt.Errorf("etcd did not come up: %w", err)
	}
	return cl, nil
}

// stop closes the client and stops the members.
func (cl *etcdCluster) stop() {
	if cl.cli != nil {
		cl.cli.Close()
	}
	for _, c := range cl.children {
		c.Stop(stopTimeout)
	}
}

// etcdSystem is the etcd side of the benchmark.
type etcdSystem struct {
	alloc *etcdAllocator
	slice slice
}

func (s *etcdSystem) acquire(ctx context.Context) (func(context.Context) error, error) {
	h, err := s.alloc.acquire(ctx, s.slice)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) error { return s.alloc.release(ctx, h) }, nil
}

// idle checks that no device record holds an allocation: releases free
// the capacity in the call.
func (s *etcdSystem) idle(ctx context.Context) error {
	devs, _, err := readPool(ctx, s.alloc.cli)
	if err != nil {
		return err
	}
	for i := range devs {
		if n := len(devs[i].Allocations); n > 0 {
			return fmt.Errorf("%s still has %d allocations after every release returned", devs[i].key(), n)
		}
	}
	return nil
}

func (s *etcdSystem) retries() int64 { return s.alloc.conflicts.Load() }
