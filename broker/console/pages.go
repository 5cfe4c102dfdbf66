package console

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"html/template"
	"net/http"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// bigReply lets a list of a large pool through (10k hosts with 8 GPUs
// each is about 15 MB).
var bigReply = grpc.MaxCallRecvMsgSize(512 << 20)

// part is one element of a page's live region that a stream replaces on
// its own (a host's row of the heatmap).
type part struct {
	ID   string `json:"id"`
	HTML string `json:"html"`
}

// liveDoc is a page's live region: the whole of it, and for the pool its
// rows, so that a stream sends only the rows that changed while the
// region's shape (which rows, in which order) stays the same.
type liveDoc struct {
	Whole string
	Shape string
	Parts []part
}

// layoutData is what the page layout shows around the live region.
type layoutData struct {
	Title   string
	Page    string
	Session *session
	// CSRF is the sign-out form's CSRF token.
	CSRF     string
	ACL      bool
	ServerID string
	Error    string
	Live     template.HTML
	// Stream is the query of the page's live stream; empty: none.
	Stream string
	NowMs  int64
}

// page serves one page: sign-in first, then its filters, then its data.
func (s *Server) page(k pageKind) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sess, fail := s.authenticate(r)
		if sess == nil {
			s.renderSignIn(w, r, fail.status(), fail.why, r.URL.RequestURI())
			return
		}
		spec := pages[k]
		data := layoutData{Title: spec.title, Page: spec.name, Session: sess, ACL: s.cfg.ACL, ServerID: s.cfg.ServerID, NowMs: time.Now().UnixMilli()}
		if sess.id != "" {
			data.CSRF = s.csrf.token(csrfSignOut, sess.id)
		}
		f, err := parseFilters(k, r.URL.Query(), r.PathValue("id"))
		if err != nil {
			data.Error = err.Error()
			s.renderLayout(w, http.StatusBadRequest, data)
			return
		}
		doc, err := s.renderLive(r.Context(), sess, k, f, fromStream{})
		if err != nil {
			st := status.Convert(err)
			if st.Code() == codes.Unauthenticated {
				s.endSession(sess)
				s.renderSignIn(w, r, http.StatusUnauthorized, "Your token was refused: "+st.Message(), r.URL.RequestURI())
				return
			}
			data.Error = st.Message()
			s.renderLayout(w, httpCode(st.Code()), data)
			return
		}
		data.Live = template.HTML(doc.Whole) // built by templates and escapeHTML only
		data.Stream = f.query(k) + "&render=" + s.baselines.put(sess, doc)
		s.renderLayout(w, http.StatusOK, data)
	})
}

func httpCode(c codes.Code) int {
	switch c {
	case codes.InvalidArgument:
		return http.StatusBadRequest
	case codes.NotFound:
		return http.StatusNotFound
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	}
	return http.StatusBadGateway
}

func (s *Server) renderLayout(w http.ResponseWriter, code int, data layoutData) {
	s.renderTemplate(w, code, "layout", data)
}

// renderTemplate renders a whole page before it sends anything, so that a
// template error is a 500, not half a page.
func (s *Server) renderTemplate(w http.ResponseWriter, code int, name string, data any) {
	var b bytes.Buffer
	if err := s.tpl.ExecuteTemplate(&b, name, data); err != nil {
		s.log.Warn("render page", "template", name, "err", err)
		http.Error(w, "the console could not render this page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	w.Write(b.Bytes())
}

// renderLive builds a page's live region from the broker's API, as the
// session. The pool page takes its hosts from in when given (a stream's
// own copy), else from ListHosts.
// fromStream is what a page's stream gathered itself: the pool's hosts
// (from WatchHosts) and a lease's events since the stream opened.
type fromStream struct {
	hosts  []*gpupoolv1.Host
	events []*gpupoolv1.LeaseEvent
}

func (s *Server) renderLive(ctx context.Context, sess *session, k pageKind, f filters, in fromStream) (liveDoc, error) {
	ctx, cancel := context.WithTimeout(sess.outgoing(ctx), 20*time.Second)
	defer cancel()
	switch k {
	case pagePool:
		hosts := in.hosts
		if hosts == nil {
			resp, err := s.api.pool.ListHosts(ctx, &gpupoolv1.ListHostsRequest{}, bigReply)
			if err != nil {
				return liveDoc{}, err
			}
			hosts = resp.Hosts
		}
		var held map[string]bool
		if f.Tenant != "" {
			ls, err := s.api.lease.List(ctx, &gpupoolv1.ListLeasesRequest{Tenant: f.Tenant,
				States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_RELEASING}}, bigReply)
			if err != nil {
				return liveDoc{}, err
			}
			held = map[string]bool{}
			for _, l := range ls.Leases {
				for _, sl := range l.Slices {
					held[sl.Device] = true
				}
			}
		}
		return s.poolDoc(hosts, f, held, time.Now())
	case pageHost:
		return s.execDoc("live-host", func() (any, error) { return s.hostView(ctx, f) })
	case pageLeases:
		return s.execDoc("live-leases", func() (any, error) { return s.leasesView(ctx, f) })
	case pageLease:
		return s.execDoc("live-lease", func() (any, error) {
			v, err := s.leaseView(ctx, sess, f)
			if v != nil {
				v.Live = in.events
			}
			return v, err
		})
	case pageQueue:
		return s.execDoc("live-queue", func() (any, error) { return s.queueView(ctx, f) })
	case pageTenants:
		return s.execDoc("live-tenants", func() (any, error) { return s.tenantsView(ctx, sess, f) })
	case pageCluster:
		return s.execDoc("live-cluster", func() (any, error) { return s.clusterView(ctx, sess) })
	}
	return liveDoc{}, fmt.Errorf("console: no page %d", k)
}

func (s *Server) execDoc(name string, view func() (any, error)) (liveDoc, error) {
	v, err := view()
	if err != nil {
		return liveDoc{}, err
	}
	var b bytes.Buffer
	if err := s.tpl.ExecuteTemplate(&b, name, v); err != nil {
		return liveDoc{}, err
	}
	return liveDoc{Whole: b.String(), Shape: b.String()}, nil
}

// --- Host ---

type hostView struct {
	Host    *gpupoolv1.Host
	GPU     string
	Devices []deviceRow
	Leases  []*gpupoolv1.Lease
	Holding int
	Labels  []string
	// DeviceIndex names a device UUID by its index, for NVLink peers.
	DeviceIndex map[string]int32
}

type deviceRow struct {
	D         *gpupoolv1.Device
	Peers     []string
	Selected  bool
	Reserved  int
	Measured  int
	HasReport bool
}

func (s *Server) hostView(ctx context.Context, f filters) (*hostView, error) {
	resp, err := s.api.pool.GetHost(ctx, &gpupoolv1.GetHostRequest{HostId: f.ID})
	if err != nil {
		return nil, err
	}
	h := resp.Host
	v := &hostView{Host: h, GPU: f.GPU, Leases: resp.Leases, DeviceIndex: map[string]int32{}, Labels: labelList(h.Labels)}
	for _, d := range h.Devices {
		v.DeviceIndex[d.Uuid] = d.Index
	}
	for _, d := range h.Devices {
		row := deviceRow{D: d, Selected: f.GPU != "" && (f.GPU == d.Uuid || f.GPU == fmt.Sprint(d.Index)),
			Reserved: reservedPercent(d), Measured: measuredPercent(d), HasReport: d.UsedMemoryMib >= 0}
		for _, p := range d.NvlinkPeers {
			if i, ok := v.DeviceIndex[p]; ok {
				row.Peers = append(row.Peers, fmt.Sprintf("GPU %d", i))
			} else {
				row.Peers = append(row.Peers, p)
			}
		}
		v.Devices = append(v.Devices, row)
	}
	for _, l := range resp.Leases {
		if l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED || l.State == gpupoolv1.LeaseState_LEASE_STATE_RELEASING {
			v.Holding++
		}
	}
	return v, nil
}

func labelList(m map[string]string) []string {
	var out []string
	for k, v := range m {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}

// --- Leases ---

type leasesView struct {
	F      filters
	Leases []*gpupoolv1.Lease // the newest maxLeaseRows that match
	// Matched is how many match; Total how many the API listed.
	Matched, Total int
}

// maxLeaseRows bounds the leases page: filters narrow it.
const maxLeaseRows = 500

func (s *Server) leasesView(ctx context.Context, f filters) (*leasesView, error) {
	req := &gpupoolv1.ListLeasesRequest{Tenant: f.Tenant, Host: f.Host, States: f.States}
	resp, err := s.api.lease.List(ctx, req, bigReply)
	if err != nil {
		return nil, err
	}
	v := &leasesView{F: f, Total: len(resp.Leases)}
	q := strings.ToLower(f.Q)
	for _, l := range resp.Leases {
		if f.Class != 0 && effectiveClass(l.Class) != f.Class {
			continue
		}
		if q != "" && !strings.Contains(strings.ToLower(l.Id+" "+l.Holder+" "+l.Tenant+" "+l.Reason), q) {
			continue
		}
		v.Leases = append(v.Leases, l)
	}
	slices.SortFunc(v.Leases, func(a, b *gpupoolv1.Lease) int { return cmp.Compare(b.CreateIndex, a.CreateIndex) })
	v.Matched = len(v.Leases)
	if len(v.Leases) > maxLeaseRows {
		v.Leases = v.Leases[:maxLeaseRows]
	}
	return v, nil
}

func effectiveClass(c gpupoolv1.LeaseClass) gpupoolv1.LeaseClass {
	if c == gpupoolv1.LeaseClass_LEASE_CLASS_UNSPECIFIED {
		return gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED
	}
	return c
}

// --- Lease ---

type leaseView struct {
	L      *gpupoolv1.Lease
	Events []*gpupoolv1.AuditEntry
	Extras []*gpupoolv1.Lease
	// Live are the lease's events since the page's stream opened, newest
	// first: notices, violations, unhealthy devices, growth, its end.
	Live []*gpupoolv1.LeaseEvent
}

func (s *Server) leaseView(ctx context.Context, sess *session, f filters) (*leaseView, error) {
	resp, err := s.api.lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: f.ID})
	if err != nil {
		return nil, err
	}
	v := &leaseView{L: resp.Lease}
	entries, err := s.auditLog(ctx, resp.Lease.Tenant, 0)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		if e.Subject == f.ID || strings.Contains(e.Detail, f.ID) {
			v.Events = append(v.Events, e)
		}
	}
	if resp.Lease.Request.GetElasticMax() > 0 {
		ls, err := s.api.lease.List(ctx, &gpupoolv1.ListLeasesRequest{Tenant: resp.Lease.Tenant})
		if err != nil {
			return nil, err
		}
		for _, l := range ls.Leases {
			if l.Parent == f.ID {
				v.Extras = append(v.Extras, l)
			}
		}
	}
	return v, nil
}

// auditLog reads the audit log (as the session may see it), newest last;
// limit 0 reads all the broker keeps.
func (s *Server) auditLog(ctx context.Context, tenant string, limit uint32) ([]*gpupoolv1.AuditEntry, error) {
	stream, err := s.api.operator.AuditLog(ctx, &gpupoolv1.AuditLogRequest{Tenant: tenant})
	if err != nil {
		return nil, err
	}
	var out []*gpupoolv1.AuditEntry
	for {
		e, err := stream.Recv()
		if err != nil {
			if status.Code(err) == codes.OK || err.Error() == "EOF" || isEOF(err) {
				break
			}
			return nil, err
		}
		out = append(out, e)
	}
	if limit > 0 && len(out) > int(limit) {
		out = out[len(out)-int(limit):]
	}
	return out, nil
}

// --- Queue ---

type queueView struct {
	Q *gpupoolv1.QueueSnapshot
	F filters
}

func (s *Server) queueView(ctx context.Context, f filters) (*queueView, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := s.api.lease.WatchQueue(ctx, &gpupoolv1.WatchQueueRequest{Tenant: f.Tenant})
	if err != nil {
		return nil, err
	}
	q, err := stream.Recv()
	if err != nil {
		return nil, err
	}
	return &queueView{Q: q, F: f}, nil
}

// --- Tenants ---

type tenantRow struct {
	Tenant  string
	Quota   *gpupoolv1.Quota
	Usage   *gpupoolv1.TenantUsage
	Dims    []quotaDim
	History []*gpupoolv1.TenantUsageSample
	Spark   []spark
}

type quotaDim struct {
	Name       string
	Used, Max  int64
	Percent    int64
	Unit       string
	HasLimit   bool
	OverLimit  bool
	NearLimit  bool
	FormatUsed string
	FormatMax  string
}

type spark struct {
	Name   string
	Points string
	Last   string
	Max    string
}

type tenantsView struct {
	Rows       []*tenantRow
	IntervalMs int64
	ServerID   string
}

func (s *Server) tenantsView(ctx context.Context, sess *session, f filters) (*tenantsView, error) {
	qs, err := s.api.operator.ListQuotas(ctx, &gpupoolv1.ListQuotasRequest{})
	if err != nil {
		return nil, err
	}
	hist, err := s.api.operator.TenantHistory(ctx, &gpupoolv1.TenantHistoryRequest{Tenant: f.Tenant})
	if err != nil {
		return nil, err
	}
	rows := map[string]*tenantRow{}
	row := func(t string) *tenantRow {
		if rows[t] == nil {
			rows[t] = &tenantRow{Tenant: t}
		}
		return rows[t]
	}
	for _, q := range qs.Quotas {
		if f.Tenant != "" && q.Quota.Tenant != f.Tenant {
			continue
		}
		r := row(q.Quota.Tenant)
		r.Quota, r.Usage = q.Quota, q.Usage
	}
	for _, h := range hist.Tenants {
		r := row(h.Tenant)
		r.History = h.Samples
		if r.Usage == nil && len(h.Samples) > 0 {
			last := h.Samples[len(h.Samples)-1]
			r.Usage = &gpupoolv1.TenantUsage{Tenant: h.Tenant, Gpus: last.Gpus, MemoryMib: last.MemoryMib, ComputePercent: last.ComputePercent, Leases: last.Leases}
		}
	}
	v := &tenantsView{IntervalMs: hist.IntervalMs, ServerID: hist.ServerId}
	for _, r := range rows {
		if !sess.mayActFor(r.Tenant) {
			continue
		}
		u := r.Usage
		if u == nil {
			u = &gpupoolv1.TenantUsage{}
		}
		q := r.Quota
		if q == nil {
			q = &gpupoolv1.Quota{}
		}
		r.Dims = []quotaDim{
			dim("GPUs", int64(u.Gpus), int64(q.Gpus), fmt.Sprint(u.Gpus), fmt.Sprint(q.Gpus)),
			dim("memory", u.MemoryMib, q.MemoryMib, mib(u.MemoryMib), mib(q.MemoryMib)),
			dim("compute", u.ComputePercent, q.ComputePercent, fmt.Sprintf("%d%%", u.ComputePercent), fmt.Sprintf("%d%%", q.ComputePercent)),
		}
		r.Spark = []spark{
			sparkOf("GPUs", r.History, func(s *gpupoolv1.TenantUsageSample) int64 { return int64(s.Gpus) }, func(n int64) string { return fmt.Sprint(n) }),
			sparkOf("memory", r.History, func(s *gpupoolv1.TenantUsageSample) int64 { return s.MemoryMib }, mib),
		}
		v.Rows = append(v.Rows, r)
	}
	slices.SortFunc(v.Rows, func(a, b *tenantRow) int { return cmp.Compare(a.Tenant, b.Tenant) })
	return v, nil
}

func dim(name string, used, max int64, fu, fm string) quotaDim {
	d := quotaDim{Name: name, Used: used, Max: max, HasLimit: max > 0, FormatUsed: fu, FormatMax: fm}
	if max > 0 {
		d.Percent = used * 100 / max
		d.OverLimit = used > max
		d.NearLimit = d.Percent >= 80
	}
	return d
}

// sparkOf draws one dimension of a history as SVG polyline points in a
// 120×24 box.
func sparkOf(name string, h []*gpupoolv1.TenantUsageSample, val func(*gpupoolv1.TenantUsageSample) int64, format func(int64) string) spark {
	sp := spark{Name: name}
	if len(h) == 0 {
		return sp
	}
	var top int64 = 1
	for _, s := range h {
		top = max(top, val(s))
	}
	var b strings.Builder
	for i, s := range h {
		x := 0.0
		if len(h) > 1 {
			x = float64(i) * 120 / float64(len(h)-1)
		}
		y := 23 - float64(val(s))*22/float64(top)
		fmt.Fprintf(&b, "%.1f,%.1f ", x, y)
	}
	sp.Points = strings.TrimSpace(b.String())
	sp.Last = format(val(h[len(h)-1]))
	sp.Max = format(top)
	return sp
}

// --- Cluster ---

type clusterView struct {
	Status      *gpupoolv1.StatusResponse
	Peers       *gpupoolv1.RaftPeersResponse
	PeersDenied string
	Audit       []*gpupoolv1.AuditEntry
}

func (s *Server) clusterView(ctx context.Context, sess *session) (*clusterView, error) {
	st, err := s.api.pool.Status(ctx, &gpupoolv1.StatusRequest{})
	if err != nil {
		return nil, err
	}
	v := &clusterView{Status: st}
	if sess.management() {
		if v.Peers, err = s.api.operator.RaftPeers(ctx, &gpupoolv1.RaftPeersRequest{}); err != nil {
			return nil, err
		}
	} else {
		v.PeersDenied = "The Raft peers are shown to management tokens only."
	}
	audit, err := s.auditLog(ctx, "", 50)
	if err != nil {
		return nil, err
	}
	slices.Reverse(audit)
	v.Audit = audit
	return v, nil
}

// --- Pool ---

// poolDoc renders the heatmap: hosts grouped by their GPUs' model, one row
// per host, one cell per GPU. held (with a tenant filter) are the devices
// the tenant holds; other cells are dimmed.
func (s *Server) poolDoc(hosts []*gpupoolv1.Host, f filters, held map[string]bool, now time.Time) (liveDoc, error) {
	type group struct {
		model string
		rows  []string
		ids   []string
	}
	groups := map[string]*group{}
	var sum poolSummary
	for _, h := range hosts {
		if f.LabelKey != "" {
			if v, ok := h.Labels[f.LabelKey]; !ok || v != f.LabelVal {
				continue
			}
		}
		var devs []*gpupoolv1.Device
		for _, d := range h.Devices {
			if ok, _ := path.Match(f.Model, d.Model); f.Model == "" || ok {
				devs = append(devs, d)
			}
		}
		if len(devs) == 0 && (f.Model != "" || len(h.Devices) > 0) {
			continue
		}
		model := "(no GPUs)"
		if len(devs) > 0 {
			model = devs[0].Model
		}
		g := groups[model]
		if g == nil {
			g = &group{model: model}
			groups[model] = g
		}
		sum.add(h, devs)
		g.rows = append(g.rows, hostRowHTML(h, devs, held, now))
		g.ids = append(g.ids, h.Id)
	}
	var models []string
	for m := range groups {
		models = append(models, m)
	}
	slices.Sort(models)
	var whole, shape strings.Builder
	whole.Grow(len(hosts) * 1300)
	parts := make([]part, 0, len(hosts)+1)
	var sb bytes.Buffer
	if err := s.tpl.ExecuteTemplate(&sb, "pool-summary", sum); err != nil {
		return liveDoc{}, err
	}
	parts = append(parts, part{ID: "pool-summary", HTML: sb.String()})
	whole.WriteString(sb.String())
	whole.WriteString(`<div class="heatmap">`)
	if len(models) == 0 {
		whole.WriteString(`<p class="empty">No host matches.</p>`)
	}
	for _, m := range models {
		g := groups[m]
		fmt.Fprintf(&whole, `<section class="group"><h3>%s <small>%d hosts</small></h3>`, escapeHTML(m), len(g.rows))
		shape.WriteString(m + "\x00")
		for i, row := range g.rows {
			whole.WriteString(row)
			parts = append(parts, part{ID: rowID(g.ids[i]), HTML: row})
			shape.WriteString(g.ids[i] + "\x00")
		}
		whole.WriteString(`</section>`)
	}
	whole.WriteString(`</div>`)
	return liveDoc{Whole: whole.String(), Shape: shape.String(), Parts: parts}, nil
}

type poolSummary struct {
	Hosts, HostsReady, HostsDraining, HostsDown, HostsIneligible int
	GPUs, GPUsUnhealthy, GPUsHeld                                int
	MemoryMib, AllocatedMemoryMib, UsedMemoryMib                 int64
}

func (p *poolSummary) add(h *gpupoolv1.Host, devs []*gpupoolv1.Device) {
	p.Hosts++
	switch h.Status {
	case gpupoolv1.HostStatus_HOST_STATUS_READY:
		p.HostsReady++
	case gpupoolv1.HostStatus_HOST_STATUS_DRAINING, gpupoolv1.HostStatus_HOST_STATUS_DRAINED:
		p.HostsDraining++
	case gpupoolv1.HostStatus_HOST_STATUS_DOWN:
		p.HostsDown++
	}
	if !h.Eligible {
		p.HostsIneligible++
	}
	for _, d := range devs {
		p.GPUs++
		if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
			p.GPUsUnhealthy++
		}
		if d.LeaseCount > 0 {
			p.GPUsHeld++
		}
		p.MemoryMib += d.MemoryMib
		p.AllocatedMemoryMib += d.AllocatedMemoryMib
		if d.UsedMemoryMib > 0 {
			p.UsedMemoryMib += d.UsedMemoryMib
		}
	}
}

func rowID(hostID string) string { return "row-" + hostID }

// reservedPercent is the larger of a device's reserved memory and compute
// shares (100 when exclusive).
func reservedPercent(d *gpupoolv1.Device) int {
	if d.AllocatedExclusive {
		return 100
	}
	p := int(d.AllocatedComputePercent)
	if d.MemoryMib > 0 {
		p = max(p, int(d.AllocatedMemoryMib*100/d.MemoryMib))
	}
	return min(p, 100)
}

// measuredPercent is the larger of the memory the agent measured in use
// and the utilisation, or -1 when there is no reading.
func measuredPercent(d *gpupoolv1.Device) int {
	if d.UsedMemoryMib < 0 {
		return -1
	}
	p := int(d.UtilizationPercent)
	if d.MemoryMib > 0 {
		p = max(p, int(d.UsedMemoryMib*100/d.MemoryMib))
	}
	return min(max(p, 0), 100)
}

// hostRowHTML renders one host's row by hand: the heatmap of a large pool
// has tens of thousands of cells. Every string from the pool goes through
// escapeHTML.
func hostRowHTML(h *gpupoolv1.Host, devs []*gpupoolv1.Device, held map[string]bool, now time.Time) string {
	b := make([]byte, 0, 256+150*len(devs))
	path := escapeURLPath(h.Id)
	b = append(b, `<div class="row `...)
	b = append(b, hostStatusName(h.Status)...)
	if !h.Eligible {
		b = append(b, " ineligible"...)
	}
	b = append(b, `" id="`...)
	b = append(b, escapeHTML(rowID(h.Id))...)
	b = append(b, `"><a class="host" href="/hosts/`...)
	b = append(b, path...)
	b = append(b, `">`...)
	b = append(b, escapeHTML(h.Id)...)
	b = append(b, `</a><span class="cells" data-host="`...)
	b = append(b, path...)
	b = append(b, `">`...)
	for _, d := range devs {
		b = appendCell(b, d, held)
	}
	b = append(b, `</span><span class="marks">`...)
	b = append(b, hostStatusBadge(h)...)
	if !h.Eligible {
		b = append(b, ` <span class="badge warn">ineligible</span>`...)
	}
	if h.Drain != nil && h.Drain.DeadlineMs > 0 && h.Status == gpupoolv1.HostStatus_HOST_STATUS_DRAINING {
		b = fmt.Appendf(b, ` deadline <span class="countdown" data-deadline="%d">%s</span>`, h.Drain.DeadlineMs, untilText(h.Drain.DeadlineMs, now))
	}
	b = append(b, `</span></div>`...)
	return string(b)
}

// appendCell appends one GPU's heatmap cell. Only the health reason comes
// from outside (the agent); the rest are numbers and fixed words.
func appendCell(b []byte, d *gpupoolv1.Device, held map[string]bool) []byte {
	r, m := reservedPercent(d), measuredPercent(d)
	b = append(b, `<i class="c r`...)
	b = strconv.AppendInt(b, int64((r+9)/10), 10)
	if m >= 0 {
		b = append(b, ` m`...)
		b = strconv.AppendInt(b, int64((m+9)/10), 10)
	}
	if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
		b = append(b, " bad"...)
	}
	if held != nil && !held[d.Uuid] {
		b = append(b, " dim"...)
	}
	b = append(b, '"')
	if d.LeaseCount > 0 {
		b = append(b, ` data-leases="`...)
		b = strconv.AppendInt(b, int64(d.LeaseCount), 10)
		b = append(b, '"')
	}
	b = append(b, ` data-gpu="`...)
	b = strconv.AppendInt(b, int64(d.Index), 10)
	b = append(b, `" title="GPU `...)
	b = strconv.AppendInt(b, int64(d.Index), 10)
	if d.LeaseCount > 0 {
		b = append(b, " · "...)
		b = append(b, mib(d.AllocatedMemoryMib)...)
		b = append(b, '/')
		b = append(b, mib(d.MemoryMib)...)
		b = append(b, ", "...)
		b = strconv.AppendInt(b, int64(d.AllocatedComputePercent), 10)
		b = append(b, "% · "...)
		b = strconv.AppendInt(b, int64(d.LeaseCount), 10)
		b = append(b, " leases"...)
	} else {
		b = append(b, " · free"...)
	}
	if m >= 0 {
		b = append(b, " · used "...)
		b = append(b, mib(d.UsedMemoryMib)...)
		b = append(b, ", "...)
		b = strconv.AppendInt(b, int64(d.UtilizationPercent), 10)
		b = append(b, '%')
	}
	if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
		b = append(b, " · "...)
		b = append(b, escapeHTML(healthName(d))...)
	}
	return append(b, `"></i>`...)
}

func hostStatusName(s gpupoolv1.HostStatus) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "HOST_STATUS_"))
}

func hostStatusBadge(h *gpupoolv1.Host) string {
	name := hostStatusName(h.Status)
	return `<span class="badge ` + name + `">` + name + `</span>`
}

func healthName(d *gpupoolv1.Device) string {
	if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
		if d.HealthReason != "" {
			return "unhealthy: " + d.HealthReason
		}
		return "unhealthy"
	}
	return "healthy"
}

func mib(n int64) string {
	switch {
	case n >= 1024 && n%1024 == 0:
		return fmt.Sprintf("%d GiB", n/1024)
	case n >= 1024:
		return fmt.Sprintf("%.1f GiB", float64(n)/1024)
	}
	return fmt.Sprintf("%d MiB", n)
}

// untilText is what is left until a deadline, as the countdowns show it
// before the script takes over.
func untilText(deadlineMs int64, now time.Time) string {
	d := time.UnixMilli(deadlineMs).Sub(now)
	if d <= 0 {
		return "now (passed)"
	}
	return "in " + d.Round(time.Second).String()
}
