package console

import (
	"fmt"
	"net/url"
	"path"
	"slices"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// pageKind is one of the console's pages.
type pageKind int

const (
	pagePool pageKind = iota
	pageHost
	pageLeases
	pageLease
	pageQueue
	pageTenants
	pageCluster
)

// pageSpec says what a page is called and which query parameters it takes.
type pageSpec struct {
	name, title string
	// params are the filters the page accepts; anything else is an error.
	params []string
	// needsID: the page is about one object, named in its path.
	needsID bool
}

var pages = map[pageKind]pageSpec{
	pagePool:    {name: "pool", title: "Pool", params: []string{"model", "label", "tenant"}},
	pageHost:    {name: "host", title: "Host", params: []string{"gpu"}, needsID: true},
	pageLeases:  {name: "leases", title: "Leases", params: []string{"tenant", "state", "host", "class", "q"}},
	pageLease:   {name: "lease", title: "Lease", needsID: true},
	pageQueue:   {name: "queue", title: "Queue", params: []string{"tenant"}},
	pageTenants: {name: "tenants", title: "Tenants", params: []string{"tenant"}},
	pageCluster: {name: "cluster", title: "Cluster"},
}

func pageByName(name string) (pageKind, bool) {
	for k, p := range pages {
		if p.name == name {
			return k, true
		}
	}
	return 0, false
}

// filters are a page's validated query parameters.
type filters struct {
	ID       string // the object of a host or lease page
	Model    string // glob
	LabelKey string
	LabelVal string
	Tenant   string
	States   []gpupoolv1.LeaseState
	Host     string
	Class    gpupoolv1.LeaseClass
	Q        string
	GPU      string
}

// query is the filters as a query string (for links and the stream).
func (f filters) query(k pageKind) string {
	v := url.Values{}
	set := func(key, val string) {
		if val != "" {
			v.Set(key, val)
		}
	}
	set("model", f.Model)
	if f.LabelKey != "" {
		v.Set("label", f.LabelKey+"="+f.LabelVal)
	}
	set("tenant", f.Tenant)
	if len(f.States) > 0 {
		var names []string
		for _, s := range f.States {
			names = append(names, stateName(s))
		}
		v.Set("state", strings.Join(names, ","))
	}
	set("host", f.Host)
	if f.Class != 0 {
		v.Set("class", className(f.Class))
	}
	set("q", f.Q)
	set("gpu", f.GPU)
	set("id", f.ID)
	v.Set("page", pages[k].name)
	return v.Encode()
}

const maxParamLen = 256

// parseFilters validates a page's query: every parameter must be one the
// page knows, given once, with a valid value. extra names parameters the
// caller handles itself.
func parseFilters(k pageKind, q url.Values, id string, extra ...string) (filters, error) {
	spec := pages[k]
	var f filters
	for key, vals := range q {
		if slices.Contains(extra, key) {
			continue
		}
		if !slices.Contains(spec.params, key) {
			if len(spec.params) == 0 {
				return f, fmt.Errorf("unknown filter %q: the %s page takes no filters", key, spec.name)
			}
			return f, fmt.Errorf("unknown filter %q: the %s page filters by %s", key, spec.name, strings.Join(spec.params, ", "))
		}
		if len(vals) != 1 {
			return f, fmt.Errorf("filter %s: give it once, not %d times", key, len(vals))
		}
		v := strings.TrimSpace(vals[0])
		if len(v) > maxParamLen {
			return f, fmt.Errorf("filter %s: at most %d characters", key, maxParamLen)
		}
		if v == "" {
			continue
		}
		if err := f.set(key, v); err != nil {
			return f, err
		}
	}
	if spec.needsID {
		if id == "" || len(id) > maxParamLen || strings.ContainsAny(id, "/\x00") {
			return f, fmt.Errorf("id %q: must name one %s (at most %d characters, no '/')", id, spec.name, maxParamLen)
		}
		f.ID = id
	}
	return f, nil
}

func (f *filters) set(key, v string) error {
	switch key {
	case "model":
		if _, err := path.Match(v, ""); err != nil {
			return fmt.Errorf("filter model %q: must be a glob such as A100*", v)
		}
		f.Model = v
	case "label":
		k, val, ok := strings.Cut(v, "=")
		if !ok || k == "" {
			return fmt.Errorf("filter label %q: must be KEY=VALUE, e.g. zone=a", v)
		}
		f.LabelKey, f.LabelVal = k, val
	case "tenant":
		if err := protocol.ValidateTenant("filter tenant", v); err != nil {
			return err
		}
		f.Tenant = v
	case "state":
		for _, name := range strings.Split(v, ",") {
			s, ok := stateByName(strings.TrimSpace(name))
			if !ok {
				return fmt.Errorf("filter state %q: must be one or more of pending, granted, releasing, released, expired, revoked (comma-separated)", name)
			}
			f.States = append(f.States, s)
		}
	case "host":
		f.Host = v
	case "class":
		switch v {
		case "guaranteed":
			f.Class = gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED
		case "preemptible":
			f.Class = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
		default:
			return fmt.Errorf("filter class %q: must be guaranteed or preemptible", v)
		}
	case "q":
		f.Q = v
	case "gpu":
		f.GPU = v
	}
	return nil
}

func stateName(s gpupoolv1.LeaseState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "LEASE_STATE_"))
}

func stateByName(name string) (gpupoolv1.LeaseState, bool) {
	v, ok := gpupoolv1.LeaseState_value["LEASE_STATE_"+strings.ToUpper(name)]
	if !ok || v == 0 {
		return 0, false
	}
	return gpupoolv1.LeaseState(v), true
}

func className(c gpupoolv1.LeaseClass) string {
	if c == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
		return "preemptible"
	}
	return "guaranteed"
}
