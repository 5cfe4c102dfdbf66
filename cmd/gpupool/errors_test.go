package main

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestErrorMessagesCarryNoGRPCWrappingOrMethodPath(t *testing.T) {
	cases := []struct {
		name string
		err  error
		want string
	}{
		{"a failed precondition is the broker's sentence",
			status.Error(codes.FailedPrecondition, "host h1 is draining"), "host h1 is draining"},
		{"a permission denied names the call in words",
			status.Error(codes.PermissionDenied, "/gpupool.v1.PoolService/DrainHost: client token ml lacks management"),
			"permission denied: drain host: client token ml lacks management"},
		{"a wrapped gRPC error loses its wrapper",
			fmt.Errorf("release l-1: %w", status.Error(codes.NotFound, "lease l-1: not found")),
			"release l-1: lease l-1: not found"},
		{"a wrapped unauthenticated error says so",
			fmt.Errorf("watch: %w", status.Error(codes.Unauthenticated, "no ACL token")),
			"watch: unauthenticated: no ACL token"},
		{"a lost quorum says what to do",
			&client.ClusterError{Voters: 3, Members: []client.Member{
				{ID: "broker-1", Addr: "a:1", Outcome: client.OutcomeNoLeader, Role: "candidate", Term: 4, Voter: true},
				{ID: "broker-2", Addr: "a:2", Outcome: client.OutcomeRefused, Voter: true},
				{ID: "broker-3", Addr: "a:3", Outcome: client.OutcomeTimeout, Voter: true},
			}},
			"lost quorum: 1 of 3 brokers reachable (broker-1); a majority (2) is needed: broker-1 (a:1): up but no leader (candidate, term 4); broker-2 (a:2): refused; broker-3 (a:3): timeout (start the brokers that are down; 'gpupool operator members' lists them)"},
		{"no broker at all names each address",
			&client.ClusterError{Members: []client.Member{{Addr: "a:1", Outcome: client.OutcomeRefused}, {Addr: "a:2", Outcome: client.OutcomeTLS, Detail: "tls: bad certificate"}}},
			"no broker reachable: a:1: refused; a:2: TLS failure: tls: bad certificate (is the cluster up? set --addr or GPUPOOL_ADDR; check --tls-ca, --tls-cert and --tls-key)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := errorMessage(c.err)
			if got != c.want {
				t.Errorf("got %q, want %q", got, c.want)
			}
			if strings.Contains(got, "rpc error") || strings.Contains(got, "gpupool.v1.") {
				t.Errorf("%q still carries gRPC's wrapping or a method path", got)
			}
		})
	}
}

func TestExitCodes(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want int
	}{
		{"an unknown command is a usage error", []string{"nosuch"}, 2},
		{"an unknown subcommand is a usage error", []string{"operator", "nosuch"}, 2},
		{"an unknown flag is a usage error", []string{"status", "--nosuch"}, 2},
		{"a bad --connect-timeout is a usage error", []string{"status", "--connect-timeout", "-1s"}, 2},
		{"-q with -o json is a usage error", []string{"lease", "ls", "-q", "-o", "json"}, 2},
		{"version succeeds", []string{"version"}, 0},
		{"--version succeeds", []string{"--version"}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			global = globalOpts{}
			var out, errOut bytes.Buffer
			if got := run(c.args, &out, &errOut); got != c.want {
				t.Errorf("gpupool %s: exit code got %d, want %d (stderr %q)", strings.Join(c.args, " "), got, c.want, errOut.String())
			}
		})
	}
}

func TestExitCodeOfAnInvalidArgumentIs2AndOfOtherFailures1(t *testing.T) {
	if got := exitCode(status.Error(codes.InvalidArgument, "memory_mib 0")); got != 2 {
		t.Errorf("InvalidArgument: got %d, want 2", got)
	}
	if got := exitCode(errors.New("boom")); got != 1 {
		t.Errorf("a plain error: got %d, want 1", got)
	}
}

func TestSliceCellFoldsManySlicesIntoACountUnlessWide(t *testing.T) {
	var ss []*gpupoolv1.Slice
	for i := range 5 {
		ss = append(ss, &gpupoolv1.Slice{Host: fmt.Sprintf("h%d", i%2), DeviceIndex: int32(i), Exclusive: true})
	}
	defer func() { global.output = "" }()
	global.output = "table"
	if got, want := sliceCell(ss), "5 slices on 2 hosts"; got != want {
		t.Errorf("table: got %q, want %q", got, want)
	}
	if got, want := sliceCell(ss[:2]), "h0/0 exclusive, h1/1 exclusive"; got != want {
		t.Errorf("two slices: got %q, want %q", got, want)
	}
	global.output = "wide"
	if got := sliceCell(ss); strings.Count(got, "exclusive") != 5 {
		t.Errorf("wide: got %q, want all 5 slices", got)
	}
}

func TestVersionOutliersFlagsTheVersionsThatDifferFromTheMostCommon(t *testing.T) {
	cases := []struct {
		name string
		vs   []string
		want string
	}{
		{"all the same flags none", []string{"v1", "v1", "v1"}, ""},
		{"one odd one out is flagged", []string{"v1", "v2", "v1"}, "v2"},
		{"nothing to compare flags none", nil, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var got []string
			for v := range versionOutliers(c.vs) {
				got = append(got, v)
			}
			if strings.Join(got, ",") != c.want {
				t.Errorf("got %q, want %q", got, c.want)
			}
		})
	}
}
