package controller

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// ClusterID is the identity of the cluster kube reaches: the UID of its
// kube-system namespace, which lives as long as the cluster.
func ClusterID(ctx context.Context, kube kubernetes.Interface) (string, error) {
	ns, err := kube.CoreV1().Namespaces().Get(ctx, metav1.NamespaceSystem, metav1.GetOptions{})
	if apierrors.IsForbidden(err) {
		return "", fmt.Errorf("read the cluster's identity (the UID of namespace kube-system): %w; "+
			"allow get on namespaces/kube-system, or give the identity with --cluster-id", err)
	}
	if err != nil {
		return "", fmt.Errorf("read the cluster's identity (the UID of namespace kube-system): %w", err)
	}
	return string(ns.UID), nil
}

// claimTenant claims tenant for cluster at the brokers before the
// controller touches the tenant's leases, retrying while they cannot be
// reached. Another cluster's claim is an error that names it. Brokers that
// cannot record claims yet (older than FSM version 3, mid-upgrade) are
// logged and let pass: the claim is made at the next start.
func claimTenant(ctx context.Context, leases gpupoolv1.LeaseServiceClient, tenant, cluster string, takeOver bool, log *slog.Logger) error {
	retry := newBackoff(100*time.Millisecond, 5*time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		resp, err := leases.ClaimTenant(cctx, &gpupoolv1.ClaimTenantRequest{Tenant: tenant, ClusterId: cluster, TakeOver: takeOver})
		cancel()
		switch code := status.Code(err); {
		case err == nil:
			if r := resp.GetReplaced(); r != nil {
				log.Warn("took the tenant over from another cluster", "tenant", tenant, "cluster", cluster, "previous_cluster", r.GetClusterId())
			} else {
				log.Info("tenant claimed for this cluster", "tenant", tenant, "cluster", cluster)
			}
			return nil
		case code == codes.Unimplemented || code == codes.FailedPrecondition:
			log.Warn("the brokers cannot record which cluster manages the tenant yet; carrying on without the claim", "tenant", tenant, "err", status.Convert(err).Message())
			return nil
		case code == codes.AlreadyExists || code == codes.InvalidArgument || code == codes.PermissionDenied || code == codes.Unauthenticated:
			return fmt.Errorf("claim tenant %s: %s", tenant, status.Convert(err).Message())
		}
		log.Warn("cannot claim the tenant at the brokers; retrying", "tenant", tenant, "err", err, "retry_in", retry.peek())
		if !clock.Sleep(ctx, clock.Real, retry.next()) {
			return ctx.Err()
		}
	}
}
