// Package initjobs makes what a secure gpupool installation in Kubernetes
// needs before its components can start: the cluster CA and the TLS
// certificates of brokers, agents and clients (TLS), and the ACL's
// bootstrap token and the tokens of the controller, the node plugin, the
// brokers and each pool host (ACL), each into a Secret. The Helm chart's
// tls-init and acl-init Jobs run them ('gpupool operator k8s tls-init' and
// 'acl-init').
//
// Both are idempotent: a Secret that exists is kept as it is (a TLS
// certificate is renewed only when it expires within RenewBefore), so
// running them again, as every 'helm upgrade' does, changes nothing but
// what is missing. Secrets made by someone else are never overwritten.
package initjobs

import (
	"context"
	"fmt"
	"io"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// ManagedByLabel marks the Secrets this package creates; its value is
// the Job that made them ("tls-init" or "acl-init").
const ManagedByLabel = "gpupool.dev/managed-by"

// secrets reads and writes the Secrets of one namespace and reports what
// it did.
type secrets struct {
	kube kubernetes.Interface
	ns   string
	out  io.Writer
	by   string // the value of ManagedByLabel
}

// get returns the Secret, or nil when it does not exist.
func (s secrets) get(ctx context.Context, name string) (*corev1.Secret, error) {
	sec, err := s.kube.CoreV1().Secrets(s.ns).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read Secret %s/%s: %w", s.ns, name, err)
	}
	return sec, nil
}

// create creates a Secret with data. It reports created=false, and the
// Secret that won, when another run created it first.
func (s secrets) create(ctx context.Context, name string, data map[string][]byte) (*corev1.Secret, bool, error) {
	sec := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: s.ns, Labels: map[string]string{ManagedByLabel: s.by}},
		Type:       corev1.SecretTypeOpaque,
		Data:       data,
	}
	got, err := s.kube.CoreV1().Secrets(s.ns).Create(ctx, sec, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		got, err = s.kube.CoreV1().Secrets(s.ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, false, fmt.Errorf("read Secret %s/%s: %w", s.ns, name, err)
		}
		return got, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("create Secret %s/%s: %w", s.ns, name, err)
	}
	fmt.Fprintf(s.out, "created Secret %s\n", name)
	return got, true, nil
}

// setKey adds or replaces one key of an existing Secret. A conflict
// (someone changed it meanwhile) fails: the next run starts over.
func (s secrets) setKey(ctx context.Context, sec *corev1.Secret, key string, value []byte) (*corev1.Secret, error) {
	sec = sec.DeepCopy()
	if sec.Data == nil {
		sec.Data = map[string][]byte{}
	}
	sec.Data[key] = value
	got, err := s.kube.CoreV1().Secrets(s.ns).Update(ctx, sec, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("update Secret %s/%s (key %s): %w", s.ns, sec.Name, key, err)
	}
	return got, nil
}
