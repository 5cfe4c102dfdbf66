package main

import (
	"crypto/tls"
	"fmt"
	"github.com/gpupool/gpupool/agent/sandbox"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/agent"
	"github.com/gpupool/gpupool/agent/cudaserver"
	"github.com/gpupool/gpupool/agent/device"
	"github.com/gpupool/gpupool/agent/mps"
	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/dataplane"
	"github.com/gpupool/gpupool/internal/pki"
	"github.com/gpupool/gpupool/internal/version"
)

// machineIDFile names this host for --host-id's default.
var machineIDFile = "/etc/machine-id"

type agentOpts struct {
	tokenFile       string
	dataBind        string
	dataLimits      dataplane.Limits
	cudaLimits      cudaserver.SessionLimits
	dataDir         string
	mps             string
	simControl      string
	nvmlLibrary     string
	enforce         agent.Enforcement
	healthyAfter    time.Duration
	metrics         string
	brokers         string
	simulate        string
	hostID          string
	address         string
	labels          []string
	cpu             int64
	hostMemory      int64
	cpuFloor        int64
	memoryFloor     int64
	logLevel        string
	insecure        bool
	users           string
	allowReduced    bool
	cgroupParent    string
	metricsTLS      bool
	metricsLeaseIDs bool
	// dcgmJobMappingDir is DCGM's HPC job mapping directory; empty writes none.
	dcgmJobMappingDir string
}

func newAgentCmd() *cobra.Command {
	var o agentOpts
	cmd := &cobra.Command{
		Use:   "agent --broker ADDR[,ADDR] [--simulate SPEC] [--host-id ID] [--label k=v]...",
		Short: "Run the pool-host agent: register this host's GPUs and heartbeat",
		Long: `Run the agent of one pool host. It finds the host's GPUs, registers them with
the brokers and keeps a heartbeat stream open, over which the broker sends the
leases this host must enforce and those it must tear down. It reconnects by
itself when brokers restart or the leader changes, and runs until SIGINT or
SIGTERM.

GPUs come from NVML (libnvidia-ml.so.1). On a host without the library the
agent still registers, with no GPUs, and says why. --simulate replaces NVML by
simulated GPUs (go-nvml mock servers): SPEC is NxMODEL[:nvlink=K][:pcie=P]
[,...], N from 1 to 64, MODEL one of ` + strings.Join(device.SimModels(), ", ") + `. K GPUs in a row of
a part share an NVLink domain (default 8, 0 for none), P a PCIe root (default
2). Their UUIDs derive from --host-id, so they are the same after a restart.

Enforcement. A lease's processes are those in its cgroup (see Isolation;
on a host without cgroups, those whose environment carries
GPUPOOL_LEASE_ID=<lease id>). Every --watchdog-poll the agent reads each GPU
process's memory from NVML and sums it per lease and GPU. A lease that uses
more than its slice, or any memory on a GPU it does not hold, for longer than
--watchdog-grace gets SIGTERM, then SIGKILL after --kill-after; the holder
hears of it. Whole GPUs are "exclusive". Fractional slices are "mps" when
nvidia-cuda-mps-control is available (--mps auto|on|off): one MPS daemon per
shared GPU, and the lease's processes get a pinned memory limit and an active
thread percentage (a ceiling on compute, not a reservation). Without MPS they
are "watchdog": memory is enforced after the fact and compute is not limited.

Isolation. Every process the data plane starts for a lease runs in the
lease's sandbox: its own unprivileged user from --sandbox-users, a private
mount namespace in which the data dir is hidden and only the lease's
directory is writable, a PID namespace with its own /proc, and a cgroup
per lease (v2, or v1 on hybrid hosts) that caps the host CPU and memory the
lease asked for and holds all its processes: that cgroup, not the
environment, is how the watchdog and teardown find them. A lease that asks
for no host CPU (or memory) is capped at its share of the host's GPUs (the
sum of its slices' compute percentages over 100, a whole GPU counting 1,
divided by the host's GPUs) times --cpu (--host-memory), and at least
--default-cpu-floor (--default-memory-floor). The brokers do not count these
default caps: only explicit requests are accounted. The agent needs
root for this. Where a mechanism is missing it says so at start and exec is
refused, unless --allow-reduced-isolation runs workloads as the agent's
user. Forward reaches only a port a process of the lease listens on.

Safety. The agent keeps one state file per lease in --data-dir and resumes
enforcing after a restart, adopting the leases' running processes; at start
it kills what runs in every lease cgroup under --cgroup-parent whose lease it
no longer holds. While the brokers are unreachable, a lease's
processes run until the lease's expiry plus --expiry-grace, then are stopped.
A GPU with an Xid error (except the application Xids 13, 31, 43, 45, 68, 109),
a double-bit ECC error or lost from the bus is reported unhealthy and takes no
new leases.

With --simulate, tests and demos drive the simulated GPUs through a control
socket (--sim-control): see 'gpupool agent simulate --help'.

Security. The connection to the brokers is mutual TLS with the agent's
certificate (--tls-ca, --tls-cert, --tls-key; issue it with 'gpupool operator
tls issue --role agent --host-id ID'), reloaded when the files change. A
certificate bound to a host id serves only that host, and gives --host-id its
default. The agent joins with an agent token (--token, GPUPOOL_TOKEN or
--token-file) made for its host id ('gpupool operator acl token create --kind
agent --host-id ID'); the brokers refuse it for any other host id, and refuse
an agent without a token unless they run with --acl=false. Without TLS files
the agent refuses to start, unless --insecure says to connect in plaintext
without a token, to brokers started with --insecure (tests and local
experiments only). The QUIC data plane is TLS too, and admits only holders of
a lease token the brokers signed.

--broker defaults to $GPUPOOL_ADDR, else --addr. --host-id defaults to the
host id of the certificate, else the first 12 characters of /etc/machine-id,
else the hostname.`,
		Example: `  # offer this host's GPUs to a cluster
  export GPUPOOL_TOKEN=<agent secret for gpu-7>
  gpupool agent --broker 10.0.0.1:7641,10.0.0.2:7641,10.0.0.3:7641 --label zone=eu-1a \
    --tls-ca /etc/gpupool/ca.pem --tls-cert /etc/gpupool/gpu-7.pem --tls-key /etc/gpupool/gpu-7-key.pem

  # a simulated DGX A100 for a local 'gpupool dev' cluster (no TLS, no token)
  gpupool agent --simulate 8xA100-80GB --host-id sim-1 --insecure

  # a simulated mixed host that also offers host CPU and memory
  gpupool agent --simulate 4xA100-80GB,4xH100-80GB --host-id sim-2 --cpu 32000 --host-memory 131072 --insecure`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runAgent(cmd, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.tokenFile, "token-file", "", "read the agent join token from this file (e.g. a mounted Kubernetes Secret) instead of --token")
	f.StringVar(&o.brokers, "broker", "", "broker addresses, comma-separated (default $GPUPOOL_ADDR, else --addr)")
	f.StringVar(&o.simulate, "simulate", "", "simulate GPUs instead of using NVML, e.g. 8xA100-80GB, 4xA100-80GB,4xH100-80GB or 8xA100-40GB:nvlink=4:pcie=4")
	f.StringVar(&o.hostID, "host-id", "", "stable id of this host (default: /etc/machine-id's first 12 characters, else the hostname)")
	f.StringVar(&o.address, "address", "", "data-plane address (HOST:PORT) advertised to lease holders (default: the address --data-bind listens on)")
	f.StringVar(&o.dataBind, "data-bind", "127.0.0.1:7650", "where the QUIC data plane listens (UDP); empty runs none")
	o.dataLimits = dataplane.DefaultLimits()
	f.Float64Var(&o.dataLimits.ClientConnRate.PerSecond, dataplane.FlagClientConnRate, o.dataLimits.ClientConnRate.PerSecond, "new data-plane connections one client address may open per second; a connection over it is closed with RESOURCE_EXHAUSTED naming the limit; 0: no limit")
	f.IntVar(&o.dataLimits.ClientConnRate.Burst, dataplane.FlagClientConnBurst, o.dataLimits.ClientConnRate.Burst, "how many new data-plane connections over --"+dataplane.FlagClientConnRate+" one client address may open in a burst (at least 1)")
	f.IntVar(&o.dataLimits.ClientConns, dataplane.FlagClientConns, o.dataLimits.ClientConns, "data-plane connections one client address may hold open at once; 0: no limit")
	f.IntVar(&o.dataLimits.LeaseStreams, dataplane.FlagLeaseStreams, o.dataLimits.LeaseStreams, "data-plane streams (exec, put, get, forward, usage, cuda) one lease token may hold open at once; over it a stream is refused with RESOURCE_EXHAUSTED; 0: no limit")
	o.cudaLimits = cudaserver.DefaultSessionLimits()
	for _, l := range []struct {
		v          *int
		flag, what string
	}{
		{&o.cudaLimits.Contexts, cudaserver.FlagSessionContexts, "contexts (cuCtxCreate; primary contexts are not counted)"},
		{&o.cudaLimits.Streams, cudaserver.FlagSessionStreams, "streams"},
		{&o.cudaLimits.Events, cudaserver.FlagSessionEvents, "events"},
		{&o.cudaLimits.Modules, cudaserver.FlagSessionModules, "modules and libraries loaded"},
		{&o.cudaLimits.Functions, cudaserver.FlagSessionFunctions, "functions and kernels resolved in them"},
	} {
		f.IntVar(l.v, l.flag, *l.v, "remote CUDA: "+l.what+" one process of a lease may hold at once, 1 to 65536; one more fails with CUDA_ERROR_OUT_OF_MEMORY")
	}
	f.StringArrayVar(&o.labels, "label", nil, "host label as key=value; repeat for more")
	f.Int64Var(&o.cpu, "cpu", -1, "host CPU offered to workloads, in millicores (default: all of this machine's; 0 offers none)")
	f.Int64Var(&o.hostMemory, "host-memory", -1, "host memory offered to workloads, in MiB (default: all of this machine's; 0 offers none)")
	f.Int64Var(&o.cpuFloor, "default-cpu-floor", agent.DefaultCPUFloorMillicores, "the least CPU, in millicores, a lease that names no --host-cpu is capped at; above that its cap is its share of this host's GPUs times --cpu")
	f.Int64Var(&o.memoryFloor, "default-memory-floor", agent.DefaultMemoryFloorMiB, "the least memory, in MiB, a lease that names no --host-memory is capped at; above that its cap is its share of this host's GPUs times --host-memory")
	f.StringVar(&o.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	f.StringVar(&o.metrics, "metrics-bind", "", "serve Prometheus metrics at http://ADDR/metrics; empty serves none")
	f.StringVar(&o.dataDir, "data-dir", "/var/lib/gpupool/agent", "directory for the per-lease state files")
	f.StringVar(&o.nvmlLibrary, "nvml-library", "", "the NVML library the agent opens for the host's GPUs (default $GPUPOOL_NVML_LIBRARY, else libnvidia-ml.so.1 from the loader's path); a path that does not exist offers no GPUs, and the agent says so")
	f.StringVar(&o.mps, "mps", "auto", "run CUDA MPS daemons for fractional slices: auto (when nvidia-cuda-mps-control is on PATH), on or off")
	f.StringVar(&o.simControl, "sim-control", "", "with --simulate: unix socket to drive the simulated GPUs (default DATA_DIR/simulate.sock)")
	f.DurationVar(&o.enforce.Poll, "watchdog-poll", agent.DefaultPoll, "how often the watchdog reads per-process GPU memory")
	f.DurationVar(&o.enforce.Grace, "watchdog-grace", agent.DefaultGrace, "how long a lease may exceed its memory before its processes are stopped")
	f.DurationVar(&o.enforce.KillAfter, "kill-after", agent.DefaultKillAfter, "how long a process has after SIGTERM before SIGKILL")
	f.DurationVar(&o.enforce.ExpiryGrace, "expiry-grace", agent.DefaultExpiryGrace, "how long past its expiry a lease's processes run while the brokers are unreachable")
	f.DurationVar(&o.healthyAfter, "healthy-after", agent.DefaultHealthyAfter, "how long after its last critical event (Xid, ECC, lost) a GPU marked unhealthy counts as healthy again; the mark survives restarts (DATA_DIR/memory.json)")
	f.BoolVar(&o.insecure, "insecure", false, insecureUsage)
	f.StringVar(&o.dcgmJobMappingDir, "dcgm-job-mapping-dir", "", "write each lease's id into DCGM's HPC job mapping files here (one file per GPU index; dcgm-exporter --hpc-job-mapping-dir), so DCGM's per-GPU metrics carry the lease; empty writes none")
	f.StringVar(&o.users, "sandbox-users", sandbox.DefaultRange.String(), "user ids leases run as, FIRST-LAST; each lease takes one (the first is shared by leases with MPS slices); give each agent on one machine its own range")
	f.StringVar(&o.cgroupParent, "cgroup-parent", "", "where the leases' cgroups go under each cgroup hierarchy's root (default gpupool/HOST_ID); give each agent on one machine its own: a starting agent kills what runs in the lease cgroups under it whose lease it does not hold")
	f.BoolVar(&o.metricsTLS, "metrics-tls", false, "serve --metrics-bind over mutual TLS with the agent's certificate: scrapers need a certificate of the cluster CA")
	f.BoolVar(&o.metricsLeaseIDs, "metrics-lease-ids", false, "label per-lease metrics with the lease id; by default the label is a pseudonym (h-<hash>) that names no lease")
	f.BoolVar(&o.allowReduced, "allow-reduced-isolation", false, "run lease workloads even where this host cannot sandbox them (not root, no cgroups): they then run as the agent's user and can reach what it can (gpupool dev sets it)")
	cmd.AddCommand(newAgentSimulateCmd(), newAgentCudaServerCmd())
	return cmd
}

func runAgent(cmd *cobra.Command, o agentOpts) error {
	logger, err := newLogger(o.logLevel)
	if err != nil {
		return err
	}
	brokers := o.brokers
	if !cmd.Flags().Changed("broker") {
		if brokers = os.Getenv("GPUPOOL_ADDR"); brokers == "" {
			brokers = global.addr
		}
	}
	addrs := client.ParseAddrs(brokers)
	if len(addrs) == 0 {
		return usagef("--broker is empty: give one or more broker addresses, e.g. 127.0.0.1:7641")
	}
	if err := o.dataLimits.Validate(); err != nil {
		return usagef("%v", err)
	}
	if err := o.cudaLimits.Validate(); err != nil {
		return usagef("%v", err)
	}
	labels, err := parseLabelFlag("label", o.labels)
	if err != nil {
		return err
	}
	src, err := global.tls.serverTLS("gpupool agent", pki.RoleAgent, o.insecure, logger, cmd.ErrOrStderr())
	if err != nil {
		return err
	}
	hostID := o.hostID
	if src != nil {
		switch bound := src.Identity().HostID; {
		case bound != "" && hostID == "":
			hostID = bound
		case bound != "" && hostID != bound:
			return usagef("--host-id %q: --tls-cert %s is bound to host %q; use that host's certificate, or --host-id %s", hostID, global.tls.cert, bound, bound)
		}
	}
	if hostID == "" {
		if hostID, err = defaultHostID(); err != nil {
			return err
		}
	}

	if err := agent.CheckHostID(hostID); err != nil {
		return usagef("--host-id %v", err)
	}
	if o.cpu < -1 || (o.cpu == -1 && cmd.Flags().Changed("cpu")) {
		return usagef("--cpu %d: must be 0 or more millicores", o.cpu)
	}
	if o.hostMemory < -1 || (o.hostMemory == -1 && cmd.Flags().Changed("host-memory")) {
		return usagef("--host-memory %d: must be 0 or more MiB", o.hostMemory)
	}
	if o.cpu == -1 {
		o.cpu = int64(runtime.NumCPU()) * 1000
	}
	if o.hostMemory == -1 {
		o.hostMemory = machineMemoryMiB()
	}
	for _, fl := range []struct {
		name, unit, offerFlag string
		v, least, offer       int64
	}{
		{"default-cpu-floor", "millicores", "cpu", o.cpuFloor, minCPUFloor, o.cpu},
		{"default-memory-floor", "MiB", "host-memory", o.memoryFloor, minMemoryFloor, o.hostMemory},
	} {
		// Left at its default, a floor above the offer is cut to it.
		over := cmd.Flags().Changed(fl.name) && fl.offer > 0 && fl.v > fl.offer
		switch {
		case (fl.v < fl.least || over) && fl.offer > 0:
			return usagef("--%s %d: must be between %d and %d %s (--%s)", fl.name, fl.v, fl.least, fl.offer, fl.unit, fl.offerFlag)
		case fl.v < fl.least:
			return usagef("--%s %d: must be %d %s or more", fl.name, fl.v, fl.least, fl.unit)
		}
	}

	for _, d := range []struct {
		flag string
		v    time.Duration
	}{{"watchdog-poll", o.enforce.Poll}, {"watchdog-grace", o.enforce.Grace}, {"kill-after", o.enforce.KillAfter}, {"expiry-grace", o.enforce.ExpiryGrace}, {"healthy-after", o.healthyAfter}} {
		if d.v <= 0 {
			return usagef("--%s %s: must be positive, e.g. 500ms or 2s", d.flag, d.v)
		}
	}
	if o.dataDir == "" {
		return usagef("--data-dir is empty: give a directory for the per-lease state files")
	}
	if o.metricsTLS && src == nil {
		return usagef("--metrics-tls needs the agent's TLS files (--tls-ca, --tls-cert, --tls-key)")
	}
	if p := o.cgroupParent; p != "" && (filepath.IsAbs(p) || strings.Contains(p, "..") || strings.ContainsAny(p, " \n")) {
		return usagef("--cgroup-parent %q: must be a relative path without '..', e.g. gpupool/%s", p, hostID)
	}
	users, err := sandbox.ParseRange(o.users)
	if err != nil {
		return usagef("--sandbox-users %v", err)
	}
	if o.simControl != "" && !cmd.Flags().Changed("simulate") {
		return usagef("--sim-control needs --simulate: only simulated GPUs can be driven")
	}
	token := globalToken()
	if o.tokenFile != "" {
		if token != "" {
			return usagef("--token-file with --token (or GPUPOOL_TOKEN): give one or the other")
		}
		b, err := os.ReadFile(o.tokenFile)
		if err != nil {
			return usagef("--token-file %s: %v", o.tokenFile, err)
		}
		if token = strings.TrimSpace(string(b)); token == "" {
			return usagef("--token-file %s: the file is empty; it must hold the agent's join token", o.tokenFile)
		}
	}
	switch {
	case o.insecure && token != "":
		return usagef("--token with --insecure: --insecure runs without a token; give one or the other")
	case !o.insecure && token == "":
		// Brokers with ACL on refuse it, and say so in the agent's log.
		fmt.Fprintln(cmd.ErrOrStderr(), "WARNING: no --token: only brokers running with --acl=false accept this agent; "+
			"give it a join token for this host ('gpupool operator acl token create --kind agent --host-id ID')")
	}
	mpsCtl, err := newMPS(o.mps, filepath.Join(o.dataDir, "mps"), logger)
	if err != nil {
		return err
	}

	var backend device.Backend
	if cmd.Flags().Changed("simulate") {
		if backend, err = device.NewSimulated(o.simulate, hostID, device.SimReapExited()); err != nil {
			return usagef("--simulate %v", err)
		}
	} else {
		lib := o.nvmlLibrary
		if !cmd.Flags().Changed("nvml-library") {
			lib = os.Getenv("GPUPOOL_NVML_LIBRARY")
		}
		backend = device.NewNVML(lib)
	}
	defer backend.Close()
	if sim, ok := backend.(device.Simulator); ok {
		sock := o.simControl
		if sock == "" {
			sock = filepath.Join(o.dataDir, "simulate.sock")
		}
		if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
			return fmt.Errorf("--sim-control %s: %w", sock, err)
		}
		go func() {
			if err := device.ServeSimControl(cmd.Context(), sock, sim); err != nil {
				logger.Error("simulation control socket failed", "socket", sock, "err", err)
			}
		}()
		logger.Info("simulated GPUs can be driven with 'gpupool agent simulate --socket " + sock + "'")
	}

	a, err := agent.New(agent.Config{
		Brokers:               addrs,
		Token:                 token,
		HostID:                hostID,
		Address:               o.address,
		Labels:                labels,
		CPUMillicores:         o.cpu,
		MemoryMiB:             o.hostMemory,
		DefaultCPUFloor:       o.cpuFloor,
		DefaultMemoryFloorMiB: o.memoryFloor,
		Backend:               backend,
		Version:               agentVersion(),
		Logger:                logger,
		DataDir:               o.dataDir,
		Enforcement:           o.enforce,
		HealthyAfter:          o.healthyAfter,
		MPS:                   mpsCtl,
		DataBind:              o.dataBind,
		TLS:                   tlsConfigOf(src),
		SandboxUsers:          users,
		AllowReducedIsolation: o.allowReduced,
		MetricsLeaseIDs:       o.metricsLeaseIDs,
		CgroupParent:          o.cgroupParent,
		CudaServer:            cudaServerCommand(),
		DataLimits:            &o.dataLimits,
		CudaLimits:            &o.cudaLimits,

		DCGMJobMappingDir: o.dcgmJobMappingDir,
	})
	if err != nil {
		return usagef("%v", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(a.Collector(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	var metricsTLS *tls.Config
	if o.metricsTLS {
		metricsTLS = src.ServerConfig()
	}
	if err := serveMetricsWith(cmd.Context(), o.metrics, reg, a.Ready, logger, metricsTLS); err != nil {
		return err
	}
	return a.Run(cmd.Context())
}

// newMPS returns the MPS controller --mps asks for, or nil for none.
func newMPS(mode, dir string, logger *slog.Logger) (agent.MPS, error) {
	path, found := mps.Find()
	switch mode {
	case "off":
		return nil, nil
	case "auto":
		if !found {
			logger.Info("no " + mps.Binary + " on PATH: fractional slices are enforced by the watchdog alone")
			return nil, nil
		}
	case "on":
		if !found {
			return nil, usagef("--mps on: %s is not on PATH; install the CUDA MPS tools or use --mps auto", mps.Binary)
		}
	default:
		return nil, usagef("--mps %q: must be auto, on or off", mode)
	}
	return mps.New(path, dir, logger), nil
}

// defaultHostID is the first 12 characters of the machine id, else the
// hostname.
func defaultHostID() (string, error) {
	if b, err := os.ReadFile(machineIDFile); err == nil {
		if id := strings.TrimSpace(string(b)); len(id) >= 12 {
			return id[:12], nil
		}
	}
	name, err := os.Hostname()
	if err != nil || name == "" {
		return "", usagef("cannot name this host from %s or its hostname (%v): give --host-id", machineIDFile, err)
	}
	return name, nil
}

// agentVersion is the version the binary was built as (see 'gpupool version').
func agentVersion() string { return version.Get().Version }

// The least a default floor may be: a CFS quota under 10 millicores is
// refused by the kernel (1 ms of a 100 ms period), and a memory cap under
// 64 MiB leaves no room for the sandbox's init.
const (
	minCPUFloor    = 10
	minMemoryFloor = 64
)

// machineMemoryMiB reads MemTotal from /proc/meminfo; 0 if it cannot.
func machineMemoryMiB() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			var kib int64
			fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), &kib)
			return kib / 1024
		}
	}
	return 0
}

// cudaServerCommand is how the agent starts a lease's CUDA server: its own
// binary's hidden 'agent cuda-server', named /proc/self/exe, which the
// process starting it resolves to the agent's binary wherever it is and
// whatever a lease's mount namespace hides, so that the server always
// speaks the agent's version of the protocol.
func cudaServerCommand() []string {
	return []string{"/proc/self/exe", "agent", "cuda-server"}
}
