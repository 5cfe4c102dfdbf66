package nodeplugin

import (
	"fmt"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/types"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/k8s/driver"
)

// What the node plugin puts into a container through CDI: one CDI device
// per prepared claim, of kind CDIKind and named after the claim's UID,
// whose edits set these variables (one comma-separated entry per device
// of the claim, in allocation order) and bind-mount the claim's state
// directory read-only at ContainerDir, where client.FromEnv finds
// ContainerTokenFile through client.TokenFileEnv.
const (
	CDIKind            = driver.Name + "/claim"
	ContainerDir       = "/var/run/gpupool"
	ContainerTokenFile = ContainerDir + "/" + tokenFileName

	EnvLeaseID        = "GPUPOOL_LEASE_ID"
	EnvAgentAddr      = "GPUPOOL_AGENT_ADDR"
	EnvMemoryMiB      = "GPUPOOL_MEMORY_MIB"
	EnvComputePercent = "GPUPOOL_COMPUTE_PERCENT"
)

// tokenFileName is the token file's name in a claim's state directory.
const tokenFileName = "token.json"

// CDIDeviceID is the CDI device of the claim with uid, as the kubelet
// hands it to the container runtime.
func CDIDeviceID(uid types.UID) string { return CDIKind + "=" + string(uid) }

// checkClaimUID refuses a UID that cannot name a CDI device, a file or a
// directory; Kubernetes' UIDs are UUIDs.
func checkClaimUID(uid types.UID) error {
	if parser.ValidateDeviceName(string(uid)) != nil {
		return fmt.Errorf("claim UID %q: must be letters, digits, '-', '_', '.' and ':', starting and ending with a letter or digit", uid)
	}
	return nil
}

// cdiSpecs writes and removes the node plugin's CDI spec files in one
// directory, one file per claim.
type cdiSpecs struct {
	cache *cdi.Cache
	shim  string // the CUDA shim on the node, or "" for no remote CUDA
}

func newCDISpecs(dir, shim string) (*cdiSpecs, error) {
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if err != nil {
		return nil, fmt.Errorf("CDI spec directory %s: %w", dir, err)
	}
	return &cdiSpecs{cache: cache, shim: shim}, nil
}

// specFileName is the name of claim uid's spec file.
func specFileName(uid types.UID) string { return driver.Name + "-" + string(uid) + ".json" }

// write replaces the spec of the claim with uid, whose state directory on
// the node is stateDir and whose leases are leases, atomically.
func (s *cdiSpecs) write(uid types.UID, stateDir string, leases []claimDeviceLease) error {
	spec := claimSpec(uid, stateDir, leases, s.shim)
	v, err := cdi.MinimumRequiredVersion(spec)
	if err != nil {
		return fmt.Errorf("CDI spec of claim %s: %w", uid, err)
	}
	spec.Version = v
	if err := s.cache.WriteSpec(spec, specFileName(uid)); err != nil {
		return fmt.Errorf("CDI spec of claim %s: %w", uid, err)
	}
	return nil
}

// remove removes the spec of the claim with uid; no spec is no error.
func (s *cdiSpecs) remove(uid types.UID) error {
	if err := s.cache.RemoveSpec(specFileName(uid)); err != nil {
		return fmt.Errorf("CDI spec of claim %s: %w", uid, err)
	}
	return nil
}

// claimSpec is the CDI spec of the claim with uid: one device, named uid.
// With shim, the CUDA shim's path on the node, the device also carries
// remote CUDA (see ShimContainerPaths).
func claimSpec(uid types.UID, stateDir string, leases []claimDeviceLease, shim string) *cdispec.Spec {
	var ids, addrs, mem, compute []string
	for _, l := range leases {
		ids = append(ids, l.LeaseID)
		addrs = append(addrs, l.AgentAddress)
		mem = append(mem, strconv.FormatInt(l.MemoryMiB, 10))
		compute = append(compute, strconv.FormatInt(int64(l.ComputePercent), 10))
	}
	spec := &cdispec.Spec{
		Kind: CDIKind,
		Devices: []cdispec.Device{{
			Name: string(uid),
			ContainerEdits: cdispec.ContainerEdits{
				Env: []string{
					EnvLeaseID + "=" + strings.Join(ids, ","),
					EnvAgentAddr + "=" + strings.Join(addrs, ","),
					EnvMemoryMiB + "=" + strings.Join(mem, ","),
					EnvComputePercent + "=" + strings.Join(compute, ","),
					client.TokenFileEnv + "=" + ContainerTokenFile,
				},
				Mounts: []*cdispec.Mount{{
					HostPath:      stateDir,
					ContainerPath: ContainerDir,
					Options:       []string{"ro", "nosuid", "nodev", "noexec", "bind"},
				}},
			},
		}},
	}
	if shim != "" {
		edits := &spec.Devices[0].ContainerEdits
		edits.Env = append(edits.Env, EnvCUDASocket+"="+ContainerCUDASocket)
		for _, p := range ShimContainerPaths() {
			edits.Mounts = append(edits.Mounts, &cdispec.Mount{
				HostPath: shim, ContainerPath: p, Options: []string{"ro", "nosuid", "nodev", "bind"},
			})
		}
	}
	return spec
}
