package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

func newLeaseCmd() *cobra.Command {
	return newGroupCmd(&cobra.Command{
		Use:   "lease",
		Short: "Acquire, renew, inspect and release leases on GPUs and GPU slices",
		Long: `A lease holds whole GPUs (--exclusive) or fractional slices of GPUs (memory MiB
plus compute %) on one or more pool hosts for as long as it is renewed. Its
fencing token (the Raft index of the grant) lets agents refuse stale holders.

A lease lives for its TTL unless renewed: keep it alive with 'gpupool lease
keepalive', end it with 'gpupool lease release'. A request that does not fit
now can wait in the brokers' queue ('acquire --wait'); an elastic lease
('acquire --elastic') grows extra slices while capacity is free.`,
		Example: `  gpupool lease acquire --memory 20GiB --compute 25 --ttl 10m
  gpupool lease acquire --memory 20GiB --compute 25 --elastic 2..6 --wait 10m
  gpupool lease keepalive l-42
  gpupool lease ls --tenant team-a
  gpupool lease ls --pending
  gpupool lease release l-42`,
	},
		newLeaseAcquireCmd(),
		newLeaseKeepAliveCmd(),
		newLeaseGetCmd(),
		newLeaseListCmd(),
		newLeaseReleaseCmd(),
	)
}

// acquireFlags are the flags of 'lease acquire', as typed.
type acquireFlags struct {
	gpus       int32
	memory     string
	compute    string
	exclusive  bool
	model      string
	minMemory  string
	host       string
	labels     []string
	topology   string
	ttl        time.Duration
	tenant     string
	holder     string
	requestID  string
	class      string
	priority   int32
	hostCPU    int64
	hostMemory string
	// wait and elastic are flags of 'lease acquire' only.
	wait    time.Duration
	elastic string

	changed func(name string) bool   // whether a flag was given
	lookup  func(name string) string // a flag's value, as typed
}

// defaultHolder is "$USER@$HOSTNAME", the holder a lease acquired from a
// shell names.
func defaultHolder() string {
	user := os.Getenv("USER")
	if user == "" {
		user = "unknown"
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = os.Getenv("HOSTNAME")
	}
	if host == "" {
		host = "localhost"
	}
	return user + "@" + host
}

func (f *acquireFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	f.changed = fs.Changed
	f.lookup = func(name string) string {
		if fl := fs.Lookup(name); fl != nil {
			return fl.Value.String()
		}
		return ""
	}
	fs.Int32Var(&f.gpus, "gpus", 1, "how many GPUs (or slices, one per GPU)")
	fs.StringVar(&f.memory, "memory", "", "GPU memory per slice: 20GiB, 512MiB, or a plain number of MiB")
	fs.StringVar(&f.compute, "compute", "", "compute per slice in percent of one GPU's SMs, 1-100 (a ceiling, not a reservation)")
	fs.BoolVar(&f.exclusive, "exclusive", false, "lease whole GPUs instead of slices")
	fs.StringVar(&f.model, "model", "", `only GPUs whose model matches this shell glob, e.g. "A100*"`)
	fs.StringVar(&f.minMemory, "min-memory", "", "only GPUs with at least this much memory in total, e.g. 40GiB")
	fs.StringVar(&f.host, "host", "", "only this pool host (exact host ID)")
	fs.StringArrayVar(&f.labels, "label", nil, "only hosts with this label, key=value (repeatable)")
	fs.StringVar(&f.topology, "topology", "", "how the GPUs relate: "+strings.Join(enumLabels[gpupoolv1.Topology](), ", ")+" (default: no constraint)")
	fs.DurationVar(&f.ttl, "ttl", 5*time.Minute, "how long the lease lives without renewal, "+protocol.Human(protocol.MinTTL)+" to "+protocol.Human(protocol.MaxTTL))
	fs.StringVar(&f.tenant, "tenant", "", `tenant whose quota the lease counts against (default: your client token's first tenant, else "default")`)
	fs.StringVar(&f.holder, "holder", defaultHolder(), "who holds the lease (free-form: job name, pod UID)")
	fs.StringVar(&f.requestID, "request-id", "", "idempotency key: acquiring again with the same tenant and key returns the same lease (default: a new UUID)")
	fs.StringVar(&f.class, "class", "guaranteed", "lease class: "+strings.Join(enumLabels[gpupoolv1.LeaseClass](), ", "))
	fs.Int32Var(&f.priority, "priority", 0, "priority among leases of the same class (higher wins)")
	fs.Int64Var(&f.hostCPU, "host-cpu", 0, "host CPU on the pool host for a workload started there, in millicores (1000 = one CPU)")
	fs.StringVar(&f.hostMemory, "host-memory", "", "host memory on the pool host for a workload started there, e.g. 16GiB")
}

// registerQueue adds the flags of 'lease acquire' that other commands
// sharing acquireFlags do not have: waiting in the queue and elastic
// leases.
func (f *acquireFlags) registerQueue(cmd *cobra.Command) {
	f.registerWait(cmd)
	fs := cmd.Flags()
	fs.StringVar(&f.elastic, "elastic", "", "an elastic lease of MIN..MAX slices: MIN guaranteed, extras up to MAX while capacity is free, e.g. 2..6 (instead of --gpus)")
}

func (f *acquireFlags) registerWait(cmd *cobra.Command) {
	cmd.Flags().DurationVar(&f.wait, "wait", 0, "wait this long in the queue when the request does not fit now, up to "+protocol.Human(protocol.MaxWait)+" (default 0: fail at once)")
}

// acquireOptions are the client options for --wait: the wait, and the
// progress printed to w while waiting.
func (f *acquireFlags) acquireOptions(w io.Writer) []client.AcquireOption {
	if f.wait <= 0 {
		return nil
	}
	q := &queueReporter{w: w, until: time.Now().Add(f.wait), now: time.Now}
	return []client.AcquireOption{client.WithWait(f.wait), client.WithPendingProgress(q.report)}
}

// leaseRequest checks the flags and builds the request they describe.
// Every mistake is a usage error naming the flag and what is allowed.
func (f *acquireFlags) leaseRequest() (*gpupoolv1.LeaseRequest, error) {
	count, elasticMax := f.gpus, int32(0)
	if f.elastic != "" {
		var err error
		if count, elasticMax, err = parseElasticFlag(f.elastic); err != nil {
			return nil, err
		}
		if f.changed != nil && f.changed("gpus") {
			return nil, usagef("--elastic %s already sets how many slices (%d guaranteed, up to %d) and conflicts with --gpus %d: keep --elastic for an elastic lease, or keep --gpus for a fixed number of slices",
				f.elastic, count, elasticMax, f.gpus)
		}
	}
	req := &gpupoolv1.LeaseRequest{
		Count:       count,
		ElasticMax:  elasticMax,
		Exclusive:   f.exclusive,
		Constraints: &gpupoolv1.Constraints{Model: f.model, Host: f.host},
		TtlMs:       f.ttl.Milliseconds(),
		RequestId:   f.requestID,
		Tenant:      f.tenant,
		Holder:      f.holder,
		Priority:    f.priority,
	}
	slice := f.memory != "" || f.compute != ""
	switch {
	case !f.exclusive && !slice:
		return nil, usagef("say what each GPU should give: --exclusive for whole GPUs, or --memory and --compute for a fractional slice (e.g. --memory 20GiB --compute 25)")
	case !f.exclusive && f.memory == "":
		return nil, usagef("--compute needs --memory: a fractional slice has both (e.g. --memory 20GiB --compute %s)", f.compute)
	case !f.exclusive && f.compute == "":
		return nil, usagef("--memory needs --compute: a fractional slice has both (e.g. --memory %s --compute 25)", f.memory)
	}
	// With --exclusive too they are parsed, for the rules to refuse.
	if f.memory != "" {
		var err error
		if req.MemoryMib, err = parseMemoryFlag("memory", f.memory, 1); err != nil {
			return nil, err
		}
	}
	if f.compute != "" {
		var err error
		if req.ComputePercent, err = parsePercentFlag("compute", f.compute); err != nil {
			return nil, err
		}
	}
	if f.minMemory != "" {
		n, err := parseMemoryFlag("min-memory", f.minMemory, 0)
		if err != nil {
			return nil, err
		}
		req.Constraints.MinMemoryMib = n
	}
	labels, err := parseLabelFlag("label", f.labels)
	if err != nil {
		return nil, err
	}
	req.Constraints.Labels = labels
	if f.topology != "" {
		if req.Topology, err = parseEnumFlag[gpupoolv1.Topology]("topology", f.topology); err != nil {
			return nil, err
		}
	}
	if f.changed("tenant") && strings.TrimSpace(f.tenant) == "" {
		return nil, usagef("--tenant is empty: name the tenant whose quota the lease counts against, e.g. --tenant default")
	}
	if req.Class, err = parseEnumFlag[gpupoolv1.LeaseClass]("class", f.class); err != nil {
		return nil, err
	}
	req.HostCpuMillicores = f.hostCPU
	if f.hostMemory != "" {
		if req.HostMemoryMib, err = parseMemoryFlag("host-memory", f.hostMemory, 0); err != nil {
			return nil, err
		}
	}
	// The rules are the protocol's: a field it refuses is reported under
	// the flag that set it.
	if err := protocol.Validate(req); err != nil {
		return nil, f.flagError(err)
	}
	if err := protocol.ValidateWait(f.wait.Milliseconds()); err != nil {
		return nil, f.flagError(err)
	}
	// Without --request-id the SDK makes one, so that its retries of this
	// acquire are idempotent.
	return req, nil
}

// acquireFlagOf names the flag of 'lease acquire' that sets each request
// field the protocol's rules may refuse.
var acquireFlagOf = map[string]string{
	"count":                      "gpus",
	"exclusive":                  "exclusive",
	"memory_mib":                 "memory",
	"compute_percent":            "compute",
	"host_cpu_millicores":        "host-cpu",
	"host_memory_mib":            "host-memory",
	"ttl_ms":                     "ttl",
	"constraints.model":          "model",
	"constraints.min_memory_mib": "min-memory",
	"constraints.labels":         "label",
	"constraints.host":           "host",
	"topology":                   "topology",
	"class":                      "class",
	"priority":                   "priority",
	"elastic_max":                "elastic",
	"tenant":                     "tenant",
	"request_id":                 "request-id",
	"holder":                     "holder",
	"wait_ms":                    "wait",
}

// fieldNamesAsFlags rewrites the request field names a rule's text may
// mention into the flags that set them.
var fieldNamesAsFlags = func() *strings.Replacer {
	var pairs []string
	for field, flag := range acquireFlagOf {
		if strings.Contains(field, "_") && !strings.Contains(field, ".") {
			pairs = append(pairs, field, "--"+flag)
		}
	}
	return strings.NewReplacer(pairs...)
}()

// flagError turns the protocol's *FieldError into a usage error naming
// the flag, as typed, and what is allowed.
func (f *acquireFlags) flagError(err error) error {
	var fe *protocol.FieldError
	if !errors.As(err, &fe) {
		return err
	}
	flag, ok := acquireFlagOf[fe.Field]
	if !ok {
		return usagef("%v", err)
	}
	value := fmt.Sprint(fe.Value)
	if f.lookup != nil {
		if v := f.lookup(flag); v != "" {
			value = v
		}
	}
	return usagef("--%s %s: %s", flag, value, fieldNamesAsFlags.Replace(fe.Allowed))
}

// parseElasticFlag reads --elastic MIN..MAX: MIN slices guaranteed, up
// to MAX in all.
func parseElasticFlag(v string) (lo, hi int32, err error) {
	a, b, ok := strings.Cut(strings.TrimSpace(v), "..")
	n, errA := strconv.ParseInt(strings.TrimSpace(a), 10, 32)
	m, errB := strconv.ParseInt(strings.TrimSpace(b), 10, 32)
	if !ok || errA != nil || errB != nil {
		return 0, 0, usagef("--elastic %q: want MIN..MAX, e.g. --elastic 2..6 for 2 guaranteed slices and up to 6 while capacity is free", v)
	}
	lo, hi = int32(n), int32(m)
	if lo < 1 {
		return 0, 0, usagef("--elastic %s: MIN (%d) must be at least 1", v, lo)
	}
	if hi < lo {
		return 0, 0, usagef("--elastic %s: MAX (%d) must be at least MIN (%d)", v, hi, lo)
	}
	return lo, hi, nil
}

func newLeaseAcquireCmd() *cobra.Command {
	var f acquireFlags
	cmd := &cobra.Command{
		Use:   "acquire (--memory SIZE --compute PERCENT | --exclusive) [--gpus N | --elastic MIN..MAX] [--wait DURATION] [flags]",
		Short: "Lease whole GPUs or fractional GPU slices, waiting in the queue if asked",
		Long: `Acquire places and grants a lease. Ask either for whole GPUs (--exclusive) or
for a slice of each GPU: --memory (binary units: 20GiB, 512MiB; a plain number
is MiB) and --compute (percent of one GPU's SMs, 1-100; a ceiling, not a
reservation).

A request that does not fit now fails at once, unless --wait gives it time to
wait in the brokers' pending queue. The queue is served by priority
(--priority, higher first), then by arrival; a smaller request that fits is
granted ahead of larger ones that do not (backfill), and waiting guaranteed
work may preempt preemptible leases, which get a notice and a grace period
first. While it waits, acquire prints to stderr why the request is still
pending (no GPU with enough free memory, hosts draining, the tenant's quota)
whenever that changes, and every 10s; 'gpupool lease ls --pending' shows the
whole queue. Ctrl-C takes the request out of the queue and names it (exit 130).

--elastic MIN..MAX asks for an elastic lease instead of --gpus: MIN slices are
guaranteed (the lease itself), and the brokers add extra slices of the same
size while capacity is free, up to MAX in all. Each extra is a preemptible
lease of its own whose parent is the elastic lease; the brokers take extras
back, with a notice and a grace period, when waiting work needs the room, and
end them with the lease. The holder renews the extras like the lease itself:
'gpupool lease keepalive' of the lease renews its extras too, as does a lease
held through the Go SDK.

The lease lives for --ttl unless renewed with 'gpupool lease keepalive'.
Acquire is idempotent on (--tenant, --request-id): when no --request-id is
given a fresh one is made, so the client's own retries never grant twice;
give your own to make re-running the command safe.

The broker refuses a request that can never fit the pool (exit 1) and one
that does not fit now, or not within --wait (exit 1); a malformed one exits 2.`,
		Example: `  # A quarter of one GPU with 20 GiB of its memory, for 10 minutes
  gpupool lease acquire --memory 20GiB --compute 25 --ttl 10m

  # Two whole A100s joined by NVLink
  gpupool lease acquire --gpus 2 --exclusive --model 'A100*' --topology same-nvlink

  # A preemptible slice on hosts labelled zone=eu-1, as JSON
  gpupool lease acquire --memory 8Gi --compute 10 --class preemptible --label zone=eu-1 -o json

  # Wait up to 10 minutes in the queue for a whole A100, ahead of priority 0
  gpupool lease acquire --exclusive --model 'A100*' --wait 10m --priority 5

  # An elastic lease: 2 slices guaranteed, up to 6 while capacity is free;
  # keepalive renews the lease and its extras
  gpupool lease acquire --memory 20GiB --compute 25 --elastic 2..6 --ttl 10m
  gpupool lease keepalive l-42`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			req, err := f.leaseRequest()
			if err != nil {
				return err
			}
			c, err := dial()
			if err != nil {
				return err
			}
			defer c.Close()
			// --timeout bounds the talk with the brokers; the wait in the
			// queue comes on top.
			ctx, cancel := context.WithTimeout(cmd.Context(), global.timeout+f.wait)
			defer cancel()
			if req.RequestId == "" {
				// Ours, not the SDK's (which never writes req): an
				// interrupted wait names the request that left the queue.
				req.RequestId = uuid.NewString()
			}
			resp, err := c.Grant(ctx, req, f.acquireOptions(cmd.ErrOrStderr())...)
			if err != nil {
				if f.wait > 0 && cmd.Context().Err() != nil {
					// Grant set the request id on req, also when it made one.
					return &interruptedError{fmt.Sprintf("stopped waiting: request %s left the queue", req.GetRequestId())}
				}
				return err
			}
			if resp.GetExisting() && global.output != "json" {
				fmt.Fprintf(cmd.ErrOrStderr(), "request id %s matched lease %s granted earlier; showing it\n", req.GetRequestId(), resp.GetLease().GetId())
			}
			return render(cmd.OutOrStdout(), resp.GetLease(), func(w io.Writer) error { return printLease(w, resp.GetLease()) })
		},
	}
	f.register(cmd)
	f.registerQueue(cmd)
	return cmd
}

// queueReportEvery is how often 'lease acquire --wait' repeats why the
// request is still pending when the reason does not change.
const queueReportEvery = 10 * time.Second

// queueReporter prints the progress of a request waiting in the queue: a
// line whenever the reason it is pending changes, and every
// queueReportEvery otherwise. Numbers do not count as a change: reasons
// carry counts and countdowns ("revoked in 3s") that tick with every
// look.
type queueReporter struct {
	w     io.Writer
	until time.Time // when the wait runs out
	now   func() time.Time

	last   string    // the shape of the reason printed last
	lastAt time.Time // when it was printed; zero before the first line
}

// digits are the runs of digits reasonShape masks.
var digits = regexp.MustCompile(`[0-9]+`)

// reasonShape is a pending reason without its numbers.
func reasonShape(why string) string { return digits.ReplaceAllString(why, "#") }

// report is called with the pending lease; see client.WithPendingProgress.
func (q *queueReporter) report(l *gpupoolv1.Lease) {
	now := q.now()
	why := l.GetPendingReason()
	if why == "" {
		why = "the brokers have not said why yet"
	}
	shape := reasonShape(why)
	if !q.lastAt.IsZero() && shape == q.last && now.Sub(q.lastAt) < queueReportEvery {
		return
	}
	q.last, q.lastAt = shape, now
	left := max(q.until.Sub(now), 0).Truncate(time.Second)
	fmt.Fprintf(q.w, "waiting in queue (%s left): %s\n", left, why)
}

func newLeaseGetCmd() *cobra.Command {
	var stale bool
	cmd := &cobra.Command{
		Use:   "get LEASE_ID",
		Short: "Show one lease: state, fencing token, TTL, slices, isolation and live usage",
		Long: `Get shows one lease with every slice it holds. For each slice: its isolation
(exclusive: a whole GPU; mps: a fractional slice through the GPU's CUDA MPS
daemon, memory pinned and compute % a ceiling, not a reservation; watchdog: a
fractional slice on a host without MPS, memory enforced by the agent's
watchdog and compute not limited), and the live usage the agent last reported
(memory used by the lease's processes, the GPU's utilisation, processes).
VIOLATIONS counts the times the watchdog stopped the lease's processes.
Live usage is known to the leader only: with --stale it shows "-".

PROCESSES shows, per host, what the lease's processes run in there, as its
agent reports it: "sandboxed" (their own user, mount and PID namespaces in
which only the lease's directory is writable, a cgroup with the lease's host
CPU and memory, no new privileges), or "reduced" naming what the host lacks;
see docs/security.md.

A lease waiting in the queue shows why it is PENDING. An elastic lease shows
its ELASTIC range; each of its extras is a lease of its own whose PARENT is
the elastic lease. A preempted lease shows when it is revoked and for which
waiting lease (PREEMPTED).

NotFound (exit 1) for an unknown lease.`,
		Example: `  gpupool lease get l-42
  gpupool lease get l-42 -o json`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: args[0], Stale: stale})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp.GetLease(), func(w io.Writer) error { return printLeaseAndIsolation(w, resp) })
			})
		},
	}
	addStaleFlag(cmd, &stale)
	return cmd
}

// listFlags are the flags of 'lease ls'.
type listFlags struct {
	tenant  string
	host    string
	states  []string
	all     bool
	pending bool
	stale   bool
}

// listRequest checks the flags and builds the request they describe.
func (f *listFlags) listRequest() (*gpupoolv1.ListLeasesRequest, error) {
	req := &gpupoolv1.ListLeasesRequest{Tenant: f.tenant, Host: f.host, IncludeEnded: f.all, Stale: f.stale}
	if f.pending {
		switch {
		case len(f.states) > 0:
			return nil, usagef("--pending lists the leases waiting in the queue and conflicts with --state %s: keep --pending for the queue with why each lease waits, or keep --state", strings.Join(f.states, ","))
		case f.all:
			return nil, usagef("--pending lists the leases waiting in the queue and conflicts with --all, which adds ended leases: keep one of them")
		}
		req.States = []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_PENDING}
		return req, nil
	}
	for _, s := range f.states {
		st, err := parseEnumFlag[gpupoolv1.LeaseState]("state", s)
		if err != nil {
			return nil, err
		}
		req.States = append(req.States, st)
	}
	return req, nil
}

func newLeaseListCmd() *cobra.Command {
	var f listFlags
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List leases",
		Long: `Ls lists leases, oldest first and newest last. By default it shows every lease that has not
ended (pending, granted, releasing); --all adds released, expired and revoked
ones, and --state picks states explicitly.

--pending shows the queue: the leases waiting for capacity ('gpupool lease
acquire --wait'), in the order they are served (higher PRIORITY first, then
the longest WAITING), with what each WANTS and WHY it is not granted yet. A
smaller request that fits may be granted ahead of its turn (backfill).`,
		Example: `  gpupool lease ls
  gpupool lease ls --tenant team-a --host gpu-node-3
  gpupool lease ls --state releasing,expired
  gpupool lease ls --pending --tenant sim
  gpupool lease ls --all -o json
  gpupool lease ls -o wide            # every slice, not a count
  gpupool lease ls -q                 # ids only, e.g. for 'gpupool lease release'`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			req, err := f.listRequest()
			if err != nil {
				return err
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Lease.List(ctx, req)
				if err != nil {
					return err
				}
				noun := "leases"
				if f.pending {
					noun = "pending leases"
				} else {
					sortLeases(resp.Leases)
				}
				ids := idsOf(resp.GetLeases(), (*gpupoolv1.Lease).GetId)
				return renderList(cmd.OutOrStdout(), resp, noun, ids, func(w io.Writer) error {
					if f.pending {
						return printPendingLeases(w, resp.GetLeases(), time.Now())
					}
					return printLeases(w, resp.GetLeases(), time.Now())
				})
			})
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.tenant, "tenant", "", "only this tenant's leases")
	fs.StringVar(&f.host, "host", "", "only leases with a slice on this pool host")
	fs.StringSliceVar(&f.states, "state", nil, "only leases in these states, comma-separated: "+strings.Join(enumLabels[gpupoolv1.LeaseState](), ", "))
	fs.BoolVar(&f.all, "all", false, "include ended leases (released, expired, revoked)")
	fs.BoolVar(&f.pending, "pending", false, "only leases waiting in the queue, in queue order, with why each waits")
	addStaleFlag(cmd, &f.stale)
	return cmd
}

func newLeaseReleaseCmd() *cobra.Command {
	var reason string
	cmd := &cobra.Command{
		Use:   "release LEASE_ID...",
		Short: "End one or more leases",
		Long: `Release ends leases at once: their holders are no longer entitled to anything.
A lease stays "releasing" until the agent confirms its workload is gone (or
a lock-delay passes), and only then is its capacity free for others.

With several ids, each is released in turn; a failure is reported and the
rest are still released, and the command then exits 1.`,
		Example: `  gpupool lease release l-42
  gpupool lease release l-42 l-43 --reason "job finished"
  gpupool lease release $(gpupool lease ls --tenant sim -q)`,
		Args: minArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				failed := 0
				for _, id := range args {
					resp, err := c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: id, Reason: reason})
					if err != nil {
						if len(args) == 1 {
							return err
						}
						failed++
						fmt.Fprintf(cmd.ErrOrStderr(), "error: release %s: %s\n", id, errorMessage(err))
						continue
					}
					err = render(cmd.OutOrStdout(), resp.GetLease(), func(w io.Writer) error {
						_, err := fmt.Fprintf(w, "released %s: now %s (capacity is freed once the agent confirms teardown)\n",
							id, leaseStateText(resp.GetLease()))
						return err
					})
					if err != nil {
						return err
					}
				}
				if failed > 0 {
					return fmt.Errorf("%d of %d leases not released", failed, len(args))
				}
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why the lease ends, recorded on the lease")
	return cmd
}

// minInterval is the smallest --interval 'lease keepalive' accepts.
const minInterval = client.MinRenewInterval

func newLeaseKeepAliveCmd() *cobra.Command {
	var (
		once     bool
		interval time.Duration
	)
	cmd := &cobra.Command{
		Use:   "keepalive LEASE_ID...",
		Short: "Renew leases until interrupted, riding out broker failover",
		Long: `Keepalive renews the given leases over one stream to the brokers, each at a
third of its TTL (but no more often than every 500ms) unless --interval says
otherwise, and prints every renewal and every event about the leases (lost
host, revocation, preemption notices).

An elastic lease's extras are renewed with it, at the same pace: keepalive
prints "grew" when the brokers add an extra and renews it from then on,
"shrinking" when an extra is to be taken back (with when), and "shrank" when
it is gone. An extra that ends is dropped quietly: only the leases given
count for the exit code.

When the stream breaks (a broker restarts, a leader changes) keepalive
reconnects to any broker and carries on, extras included; Ctrl-C stops it and
exits 0. A lease that can no longer be renewed (released, expired, unknown)
is dropped, with its extras; when none is left keepalive exits 1.

--once renews every lease given once and exits 1 if any renewal failed, within
--timeout. It does not wait for extras: name them too to renew them once.`,
		Example: `  gpupool lease keepalive l-42
  gpupool lease keepalive l-42 l-43 --interval 10s
  gpupool lease keepalive l-42 --once
  gpupool lease keepalive l-42 -o json

  # An elastic lease: renews l-42 and every extra it grows
  gpupool lease keepalive l-42`,
		Args: minArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if once && cmd.Flags().Changed("interval") {
				return usagef("--interval paces repeated renewals and has no meaning with --once: drop one of them")
			}
			if cmd.Flags().Changed("interval") && interval < minInterval {
				return usagef("--interval %s: must be at least %s (or leave it out to renew at a third of each lease's TTL)", interval, minInterval)
			}
			c, err := dial()
			if err != nil {
				return err
			}
			defer c.Close()
			ctx := cmd.Context()
			if once {
				var cancel context.CancelFunc
				ctx, cancel = callCtx(cmd)
				defer cancel()
			}
			return c.Renew(ctx, args, keepAliveOptions(interval, once, cmd.OutOrStdout(), cmd.ErrOrStderr()))
		},
	}
	fs := cmd.Flags()
	fs.BoolVar(&once, "once", false, "renew every lease once and exit")
	fs.DurationVar(&interval, "interval", 0, "renew every lease this often (default: a third of its TTL, but no more often than every 500ms)")
	return cmd
}

// keepAliveOptions are the SDK's renewal options for 'lease keepalive':
// the pace, and the printing of answers to stdout and of outages to
// stderr.
func keepAliveOptions(interval time.Duration, once bool, stdout, stderr io.Writer) client.RenewOptions {
	return client.RenewOptions{
		Interval: interval,
		Once:     once,
		OnAnswer: keepAlivePrinter(stdout),
		OnBroken: func(why string) { fmt.Fprintf(stderr, "keepalive stream broke: %s; reconnecting…\n", why) },
	}
}

// keepAlivePrinter prints keepalive answers as JSON under -o json and as
// one line each otherwise.
func keepAlivePrinter(w io.Writer) func(*gpupoolv1.KeepAliveResponse) error {
	if global.output == "json" {
		return func(r *gpupoolv1.KeepAliveResponse) error { return printJSON(w, r) }
	}
	return func(r *gpupoolv1.KeepAliveResponse) error {
		_, err := fmt.Fprintln(w, keepAliveLine(r))
		return err
	}
}

// keepAliveLine describes one keepalive answer: "renewed l-1: ttl 10m0s",
// "not renewed l-1: lease l-1 not found", "event l-1: lost: host h1 is
// down", or for an elastic lease's extras "grew l-1: extra l-9 on h2/0
// 20GiB 25%", "shrinking l-1: …" and "shrank l-1: …".
func keepAliveLine(r *gpupoolv1.KeepAliveResponse) string {
	if ev := r.GetEvent(); ev != nil {
		if line := extraEventLine(ev); line != "" {
			return line
		}
		id := r.GetLeaseId()
		if id == "" {
			id = ev.GetLease().GetId()
		}
		line := fmt.Sprintf("event %s: %s", id, enumLabel(ev.GetType()))
		if ev.GetMessage() != "" {
			line += ": " + ev.GetMessage()
		}
		if ev.GetType() == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE && ev.GetDeadlineMs() > 0 {
			line += " (revoked at " + formatTimeMs(ev.GetDeadlineMs()) + ")"
		}
		if a := ev.GetActor(); a != nil {
			line += " [by " + protocol.ActorText(a) + "]"
		}
		return line
	}
	if why := client.RenewalFailure(r); why != "" {
		return fmt.Sprintf("not renewed %s: %s", r.GetLeaseId(), why)
	}
	return fmt.Sprintf("renewed %s: ttl %s", r.GetLeaseId(), formatMillis(r.GetTtlMs()))
}

// extraEventLine describes an event that grows or shrinks an elastic
// lease, or returns "" for any other event.
func extraEventLine(ev *gpupoolv1.LeaseEvent) string {
	x := ev.GetLease()
	if x.GetParent() == "" {
		return ""
	}
	why := ""
	if ev.GetMessage() != "" {
		why = ": " + ev.GetMessage()
	}
	switch ev.GetType() {
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN:
		return fmt.Sprintf("grew %s: extra %s on %s", x.GetParent(), x.GetId(), sliceSummary(x.GetSlices()))
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE:
		when := "soon"
		if ev.GetDeadlineMs() > 0 {
			when = "at " + formatTimeMs(ev.GetDeadlineMs())
		}
		return fmt.Sprintf("shrinking %s: extra %s on %s is taken back %s%s", x.GetParent(), x.GetId(), sliceSummary(x.GetSlices()), when, why)
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING:
		return fmt.Sprintf("shrinking %s: extra %s is releasing%s", x.GetParent(), x.GetId(), why)
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED:
		return fmt.Sprintf("shrank %s: extra %s ended%s", x.GetParent(), x.GetId(), why)
	}
	return ""
}
