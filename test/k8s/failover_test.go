package k8s

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	// foNodeLabel marks the failover test's node, and is the controllers'
	// --node-selector.
	foNodeLabel = "failover.gpupool.dev/node"
	// foLeaderLease is the coordination.k8s.io Lease the controllers elect
	// their leader with (controller.LeaderLeaseName in k8s/controller).
	foLeaderLease = "gpupool-k8s-controller"
	// foLeaseTTL is the controllers' --lease-ttl: the brokers' leases for
	// claims must outlive the failover.
	foLeaseTTL = 60 * time.Second
)

// TestControllerFailover runs two `gpupool k8s-controller` replicas under
// leader election on the suite's apiserver, against the dev broker cluster
// with 2 simulated pool hosts (4 A100 80GB). Pods with quarter-GPU claims
// are created; the leader is killed (SIGKILL: it releases nothing) as soon
// as the first claim is leased, and more pods are created while no one
// leads. Then:
//
//   - the standby takes the leader Lease, sooner than the brokers' leases
//     for claims expire (--lease-ttl), and every lease granted before the
//     kill is still granted: the new leader renews them;
//   - every pod is bound with its claim Leased=True;
//   - every claim is leased exactly once: one lease per claim device (its
//     request id) ever granted, the one the claim's status names;
//   - no orphan leases: the brokers hold no lease of the controllers'
//     tenant that no claim names, and when the pods go, every lease ends;
//   - no GPU was ever over-allocated.
func TestControllerFailover(t *testing.T) {
	start := time.Now()
	cp := sharedControlPlane(t)
	cp.ensureDeviceClass(t)
	gpupoolBinary(t)
	ctx := context.Background()
	e := &scenarioEnv{t: t, cp: cp, ns: cp.newNamespace(t), nodes: map[string]*scnNode{}}
	e.b = startBrokers(t, 2)
	e.monitor = scnStartCapacityMonitor(t, e.b.Client)
	t.Cleanup(func() { e.deleteSlices(t) })
	node := cp.addNode(t, "fo-node-1", map[string]string{foNodeLabel: "true"})
	e.nodes[node.Name] = &scnNode{name: node.Name}

	ctrls := map[int]*proc{} // by pid
	for i := range 2 {
		p := startGpupool(t, fmt.Sprintf("controller-%d", i+1), "k8s-controller",
			"--addr", e.b.Addrs, "--kubeconfig", cp.Kubeconfig, "--leader-elect-namespace", e.ns,
			"--lease-ttl", foLeaseTTL.String(), "--node-selector", foNodeLabel+"=true", "--log-level", "debug")
		ctrls[p.cmd.Process.Pid] = p
	}
	leader := func(ctx context.Context) (*proc, string, error) {
		l, err := cp.Client.CoordinationV1().Leases(e.ns).Get(ctx, foLeaderLease, metav1.GetOptions{})
		if err != nil {
			return nil, "", err
		}
		id := ""
		if l.Spec.HolderIdentity != nil {
			id = *l.Spec.HolderIdentity
		}
		// The identity is hostname_pid.
		i := strings.LastIndexByte(id, '_')
		pid, err := strconv.Atoi(id[i+1:])
		if err != nil || ctrls[pid] == nil {
			return nil, id, fmt.Errorf("leader %q is none of the controllers", id)
		}
		return ctrls[pid], id, nil
	}
	var first *proc
	var firstID string
	eventually(t, "a controller leads", time.Minute, func(ctx context.Context) error {
		var err error
		first, firstID, err = leader(ctx)
		return err
	})
	cp.waitForPools(t, e.b.HostIDs...)
	if _, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(ctx, fractionalTemplate(scnQuarterTemplate, "20Gi", "25"), metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create ResourceClaimTemplate: %v", err)
	}
	t.Logf("failover setup ready in %s; leader %s", time.Since(start).Round(time.Millisecond), firstID)

	// 14 quarters of the 16 the 4 GPUs have: a claim leased twice would
	// soon leave another pending.
	var pods []string
	for i := range 10 {
		pods = append(pods, fmt.Sprintf("pod-%02d", i))
		e.createPod(t, pods[i], scnQuarterTemplate)
	}
	var leasedAtKill []string // lease ids
	eventually(t, "a first claim leased", scnBind, func(ctx context.Context) error {
		leasedAtKill = nil
		claims, err := cp.Client.ResourceV1().ResourceClaims(e.ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, c := range claims.Items {
			if id := foLeaseID(&c); id != "" {
				leasedAtKill = append(leasedAtKill, id)
			}
		}
		if len(leasedAtKill) == 0 {
			return fmt.Errorf("none of %d claims leased", len(claims.Items))
		}
		return nil
	})
	first.stop()
	killed := time.Now()
	t.Logf("killed leader %s with %d of %d claims leased", firstID, len(leasedAtKill), len(pods))
	for i := 10; i < 14; i++ {
		pods = append(pods, fmt.Sprintf("pod-%02d", i))
		e.createPod(t, pods[i], scnQuarterTemplate)
	}

	var takeover time.Duration
	eventually(t, "the standby leads", foLeaseTTL, func(ctx context.Context) error {
		p, id, err := leader(ctx)
		if err != nil {
			return err
		}
		if p == first {
			return fmt.Errorf("still led by the killed %s", id)
		}
		takeover = time.Since(killed)
		return nil
	})
	t.Logf("the standby took over %s after the kill (leader election lease 15s, retry 2s; --lease-ttl %s)", takeover.Round(time.Millisecond), foLeaseTTL)

	leased := map[string]string{} // request id -> lease id, from the claims
	for _, name := range pods {
		lp := e.waitLeased(t, name)
		leased[scnRequestID(lp.claim.UID, lp.result)] = lp.data.LeaseID
	}
	for _, id := range leasedAtKill {
		if l := e.getLease(t, id); l.GetState() != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			t.Errorf("lease %s, granted before the failover: %s (%s), want still granted", id, l.GetState(), l.GetReason())
		}
	}

	all := foTenantLeases(t, e, true)
	byRequest := map[string][]string{}
	for _, l := range all {
		byRequest[l.GetRequestId()] = append(byRequest[l.GetRequestId()], fmt.Sprintf("%s (%s)", l.GetId(), l.GetState()))
		if want, ok := leased[l.GetRequestId()]; !ok {
			t.Errorf("orphan lease %s (%s, request %q): no claim names it", l.GetId(), l.GetState(), l.GetRequestId())
		} else if l.GetId() != want {
			t.Errorf("lease %s (%s) for request %s, whose claim names lease %s", l.GetId(), l.GetState(), l.GetRequestId(), want)
		}
	}
	for req, ids := range byRequest {
		if len(ids) != 1 {
			t.Errorf("request %s leased %d times: %v", req, len(ids), ids)
		}
	}
	if len(byRequest) != len(leased) {
		t.Errorf("%d requests leased at the brokers, %d claims leased", len(byRequest), len(leased))
	}
	e.checkNoOverallocation(t)

	for _, name := range pods {
		cp.finishPod(t, e.ns, name)
	}
	eventually(t, "every lease of the pods ended", 2*time.Minute, func(ctx context.Context) error {
		if open := foTenantLeases(t, e, false); len(open) > 0 {
			var ids []string
			for _, l := range open {
				ids = append(ids, l.GetId()+" "+l.GetState().String())
			}
			slices.Sort(ids)
			return fmt.Errorf("%d leases left: %v", len(ids), ids)
		}
		return nil
	})
}

// foLeaseID is the lease id of claim's device if it is Leased=True, else "".
func foLeaseID(claim *resourceapi.ResourceClaim) string {
	r, err := scnOurResult(claim)
	if err != nil {
		return ""
	}
	ds := scnDeviceStatus(claim, r)
	if ds == nil || !meta.IsStatusConditionTrue(ds.Conditions, scnConditionLeased) || ds.Data == nil {
		return ""
	}
	var data scnLeaseData
	if err := json.Unmarshal(ds.Data.Raw, &data); err != nil {
		return ""
	}
	return data.LeaseID
}

// foTenantLeases lists the brokers' leases of the controllers' tenant:
// those not ended, and with ended the ended ones too.
func foTenantLeases(t testing.TB, e *scenarioEnv, ended bool) []*gpupoolv1.Lease {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := e.b.Client.Lease.List(ctx, &gpupoolv1.ListLeasesRequest{Tenant: scnTenant, IncludeEnded: ended})
	if err != nil {
		t.Fatalf("list leases of tenant %s: %v", scnTenant, err)
	}
	return resp.GetLeases()
}
