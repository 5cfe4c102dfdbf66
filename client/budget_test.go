package client_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/broker"
	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func TestTheConnectBudgetEndsACallToBrokersWithoutALeaderAndNamesEach(t *testing.T) {
	// One broker of an expected three: it answers, but never elects.
	s, err := broker.New(broker.Config{DataDir: t.TempDir(), NodeID: "broker-1", BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown() })
	down := freeAddr(t)
	c, err := client.DialWith([]string{s.Addr(), down}, client.Options{ConnectTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The call's own deadline is far away: only the budget can end it.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	_, err = c.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
	var ce *client.ClusterError
	if !errors.As(err, &ce) {
		t.Fatalf("got %v, want a *ClusterError", err)
	}
	if status.Code(err) != codes.Unavailable {
		t.Errorf("code: got %s, want Unavailable", status.Code(err))
	}
	for _, want := range []string{"no leader elected within 1s", "broker-1 (" + s.Addr() + "): up but no leader", down + ": refused"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
}

func TestWithNothingListeningTheCallFailsAfterHalfTheBudget(t *testing.T) {
	a, b := freeAddr(t), freeAddr(t)
	// Half the budget is all a call waits for brokers that refuse: the
	// error comes before the call's deadline, and says refused, not a
	// timeout.
	c, err := client.DialWith([]string{a, b}, client.Options{ConnectTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	_, err = c.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
	var ce *client.ClusterError
	if !errors.As(err, &ce) {
		t.Fatalf("got %v, want a *ClusterError", err)
	}
	if got, want := err.Error(), "no broker reachable: "+a+": refused; "+b+": refused"; got != want && got != "no broker reachable: "+b+": refused; "+a+": refused" {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestMembersListsEveryBrokerReachableOrNot(t *testing.T) {
	s, err := broker.New(broker.Config{DataDir: t.TempDir(), NodeID: "broker-1", BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown() })
	down := freeAddr(t)
	c, err := client.DialWith([]string{down, s.Addr()}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		ms, err := c.Members(ctx)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if len(ms) == 2 && ms[1].Outcome == client.OutcomeUp {
			if ms[0].Addr != down || ms[0].Outcome != client.OutcomeRefused || ms[0].ID != "" {
				t.Errorf("the down address: got %+v, want refused without an id", ms[0])
			}
			if m := ms[1]; m.ID != "broker-1" || m.Role != "leader" || m.Term == 0 || !m.Voter || m.Version == "" {
				t.Errorf("the broker: got %+v, want broker-1, leader, a term, a voter with a version", m)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no leader in members within 30s: %+v", ms)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
