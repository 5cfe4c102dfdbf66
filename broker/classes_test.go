package broker

import gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"

const (
	pre = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
	gua = gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED
)
