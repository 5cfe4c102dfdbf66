package controller

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes/fake"
)

func TestOnlyTheLeaderRunsAndItHandsOverWhenItStops(t *testing.T) {
	kube := fake.NewClientset()
	started := make(chan string, 2)
	// elect runs one controller until its context ends, and returns
	// runElected's answer on the channel.
	elect := func(identity string) (context.CancelFunc, <-chan error) {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		cfg := Config{Identity: identity, Namespace: "gpupool"}.withDefaults()
		go func() {
			done <- runElected(ctx, cfg, kube, func(ctx context.Context) error {
				started <- identity
				<-ctx.Done()
				return nil
			})
		}()
		return cancel, done
	}
	stopA, doneA := elect("a")
	if got := <-started; got != "a" {
		t.Fatalf("%s leads, want a", got)
	}
	stopB, doneB := elect("b")
	t.Cleanup(stopB)

	stopA()
	if err := <-doneA; err != nil {
		t.Fatalf("a stopped with %v, want nil", err)
	}
	select {
	case got := <-started:
		if got != "b" {
			t.Fatalf("%s leads, want b", got)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("b did not take over within 30s of a stopping")
	}
	stopB()
	if err := <-doneB; err != nil {
		t.Fatalf("b stopped with %v, want nil", err)
	}
}

func TestRunAllStopsTheOthersWhenOneFails(t *testing.T) {
	boom := errors.New("boom")
	err := runAll(context.Background(),
		func(ctx context.Context) error { <-ctx.Done(); return nil },
		func(context.Context) error { return boom },
	)
	if !errors.Is(err, boom) {
		t.Fatalf("runAll = %v, want %v", err, boom)
	}
}

func TestConfigDefaults(t *testing.T) {
	nsFile := filepath.Join(t.TempDir(), "namespace")
	if err := os.WriteFile(nsFile, []byte("gpupool-system\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, env, file, given, want string
	}{
		{"the given namespace", "from-env", nsFile, "given", "given"},
		{"POD_NAMESPACE", "from-env", nsFile, "", "from-env"},
		{"the service account's namespace", "", nsFile, "", "gpupool-system"},
		{"default outside a pod", "", filepath.Join(t.TempDir(), "absent"), "", "default"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("POD_NAMESPACE", tc.env)
			old := namespaceFile
			namespaceFile = tc.file
			t.Cleanup(func() { namespaceFile = old })
			c := Config{Namespace: tc.given}.withDefaults()
			if c.Namespace != tc.want || c.Tenant != DefaultTenant || c.LeaseTTL != DefaultLeaseTTL || c.Identity == "" {
				t.Errorf("defaults %+v, want namespace %s, tenant %s, TTL %s and an identity", c, tc.want, DefaultTenant, DefaultLeaseTTL)
			}
		})
	}
}
