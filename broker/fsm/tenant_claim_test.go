package fsm

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func claimTenant(tenant, cluster string, takeOver bool) *gpupoolv1.ClaimTenantCommand {
	return &gpupoolv1.ClaimTenantCommand{
		Claim:    &gpupoolv1.TenantClaim{Tenant: tenant, ClusterId: cluster, ClaimedAtMs: 1_700_000_000_000, By: &gpupoolv1.Actor{Name: "controller"}},
		TakeOver: takeOver,
	}
}

func TestATenantIsClaimedByOneClusterOnly(t *testing.T) {
	tests := []struct {
		name string
		log  []proto.Message
		// wantErr is a part of the last command's error, "" for none.
		wantErr string
		// wantCluster holds tenant k8s after the log ("" for none),
		// wantReplaced is the cluster the last command took it from.
		wantCluster, wantReplaced string
	}{
		{"the first claim wins",
			[]proto.Message{claimTenant("k8s", "c-1", false)}, "", "c-1", ""},
		{"the same cluster claims again",
			[]proto.Message{claimTenant("k8s", "c-1", false), claimTenant("k8s", "c-1", false)}, "", "c-1", ""},
		{"another cluster is refused, naming the one that holds it",
			[]proto.Message{claimTenant("k8s", "c-1", false), claimTenant("k8s", "c-2", false)},
			`tenant "k8s" is claimed by Kubernetes cluster c-1 since 2023-11-14T22:13:20Z, and this is cluster c-2`, "c-1", ""},
		{"another tenant is another claim",
			[]proto.Message{claimTenant("k8s", "c-1", false), claimTenant("ml", "c-2", false)}, "", "c-1", ""},
		{"another cluster takes over",
			[]proto.Message{claimTenant("k8s", "c-1", false), claimTenant("k8s", "c-2", true)}, "", "c-2", "c-1"},
		{"a claim without a cluster is invalid",
			[]proto.Message{claimTenant("k8s", "", false)}, "without a cluster id", "", ""},
		{"a claim without a tenant is invalid",
			[]proto.Message{claimTenant("", "c-1", false)}, "without a tenant", "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := New(nil)
			res := applyAll(t, f, tt.log)
			last := res[len(res)-1]
			switch {
			case tt.wantErr == "" && last.Err != nil:
				t.Fatalf("got error %v, want none", last.Err)
			case tt.wantErr != "" && (last.Err == nil || !strings.Contains(last.Err.Error(), tt.wantErr)):
				t.Fatalf("got error %v, want one saying %q", last.Err, tt.wantErr)
			}
			var tce *TenantClaimedError
			if strings.Contains(tt.wantErr, "is claimed by") && !errors.As(last.Err, &tce) {
				t.Errorf("got %T, want a *TenantClaimedError", last.Err)
			}
			if got := f.State().TenantClaim("k8s").GetClusterId(); got != tt.wantCluster {
				t.Errorf("tenant k8s claimed by %q, want %q", got, tt.wantCluster)
			}
			if got := last.Replaced.GetClusterId(); got != tt.wantReplaced {
				t.Errorf("replaced the claim of %q, want %q", got, tt.wantReplaced)
			}
		})
	}
}

func TestTenantClaimsSurviveASnapshot(t *testing.T) {
	f := New(nil)
	applyAll(t, f, []proto.Message{claimTenant("k8s", "c-1", false), claimTenant("ml", "c-2", false)})
	snap := snapshotBytes(t, f)
	g := New(nil)
	if err := g.Restore(io.NopCloser(bytes.NewReader(snap))); err != nil {
		t.Fatal(err)
	}
	for tenant, want := range map[string]string{"k8s": "c-1", "ml": "c-2"} {
		if got := g.State().TenantClaim(tenant).GetClusterId(); got != want {
			t.Errorf("restored claim on %s: cluster %q, want %q", tenant, got, want)
		}
	}
	if !bytes.Equal(snapshotBytes(t, g), snap) {
		t.Error("the restored state snapshots to other bytes")
	}
	res := applyAll(t, g, []proto.Message{claimTenant("k8s", "c-3", false)})
	if res[0].Err == nil {
		t.Error("a restored claim did not refuse another cluster")
	}
}

func TestClaimTenantNeedsCommandSetVersion3(t *testing.T) {
	if v, ok := CommandVersion(ClaimTenantType); !ok || v != 3 || ClaimTenantType != 19 {
		t.Fatalf("ClaimTenant: type %d version %d (known %t), want type 19 at version 3", ClaimTenantType, v, ok)
	}
}
