package k8s

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app/testing"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app/testing"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app/testing"
	_ "go.etcd.io/etcd/server/v3/embed"
)
