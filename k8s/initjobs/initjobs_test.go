package initjobs

import (
	"strings"
	"testing"
	"time"
)

func TestConfigsRefuseBadInputNamingTheField(t *testing.T) {
	goodTLS := TLSConfig{Namespace: "ns", CASecret: "ca", BrokerSecret: "b", AgentSecret: "a", ClientSecret: "c",
		BrokerHosts: []string{"*.b.ns.svc"}, Validity: 24 * time.Hour}
	goodACL := ACLConfig{Namespace: "ns", BootstrapSecret: "boot", TokensSecret: "t", AgentTokensSecret: "at",
		ControllerKey: "controller", NodePluginKey: "node-plugin", BrokerKey: "broker", Tenant: "k8s"}
	cases := []struct {
		name string
		err  error
		want string
	}{
		{"a complete TLS config is fine", goodTLS.Validate(), ""},
		{"TLS without a namespace", func() error { c := goodTLS; c.Namespace = ""; return c.Validate() }(), "namespace"},
		{"TLS without broker hosts", func() error { c := goodTLS; c.BrokerHosts = nil; return c.Validate() }(), "broker-hosts"},
		{"TLS valid longer than the CA", func() error { c := goodTLS; c.Validity = 100 * 365 * 24 * time.Hour; return c.Validate() }(), "validity"},
		{"a complete ACL config is fine", goodACL.Validate(), ""},
		{"ACL without a tenant", func() error { c := goodACL; c.Tenant = ""; return c.Validate() }(), "tenant"},
		{"ACL with an empty key", func() error { c := goodACL; c.BrokerKey = ""; return c.Validate() }(), "keys"},
		{"ACL with a bad node selector", func() error { c := goodACL; c.AgentNodeSelector = "a b=c"; return c.Validate() }(), "agent-node-selector"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			switch {
			case c.want == "" && c.err != nil:
				t.Errorf("got %v, want nil", c.err)
			case c.want != "" && (c.err == nil || !strings.HasPrefix(c.err.Error(), c.want)):
				t.Errorf("got %v, want an error starting with %q", c.err, c.want)
			}
		})
	}
}
