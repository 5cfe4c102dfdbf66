package k8s

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/pki"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// initRun is one run of an init Job's command as a process, with the
// environment the chart's Job gives it.
type initRun struct {
	stdout, stderr string
	code           int
}

func runInit(t *testing.T, env []string, args ...string) initRun {
	t.Helper()
	cmd := exec.Command(gpupoolBinary(t), args...)
	cmd.Env = append(os.Environ(), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	r := initRun{stdout: out.String(), stderr: errOut.String()}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		r.code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return r
}

// chartInitRBAC creates the rules of the chart's init Role and ClusterRole
// for the service account sa of ns, and returns a kubeconfig that acts as
// it: the Jobs' commands run with exactly the rights the chart gives them.
func chartInitRBAC(t *testing.T, cp *controlPlane, ns, sa string) string {
	t.Helper()
	objs, err := decodeManifestFile(chartRendered(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	subject := []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: ns}}
	found := 0
	for _, o := range objs {
		if o.obj.GetName() != "gpupool-init" {
			continue
		}
		switch o.obj.GetKind() {
		case "Role":
			var r rbacv1.Role
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.obj.Object, &r); err != nil {
				t.Fatal(err)
			}
			role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: sa, Namespace: ns}, Rules: r.Rules}
			if _, err := cp.Client.RbacV1().Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: sa, Namespace: ns}, Subjects: subject,
				RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: sa}}
			if _, err := cp.Client.RbacV1().RoleBindings(ns).Create(ctx, rb, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			found++
		case "ClusterRole":
			var r rbacv1.ClusterRole
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.obj.Object, &r); err != nil {
				t.Fatal(err)
			}
			name := ns + "-" + sa
			cr := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: r.Rules}
			if _, err := cp.Client.RbacV1().ClusterRoles().Create(ctx, cr, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			crb := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name}, Subjects: subject,
				RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name}}
			if _, err := cp.Client.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				cp.Client.RbacV1().ClusterRoleBindings().Delete(context.Background(), name, metav1.DeleteOptions{})
				cp.Client.RbacV1().ClusterRoles().Delete(context.Background(), name, metav1.DeleteOptions{})
			})
			found++
		}
	}
	if found != 2 {
		t.Fatalf("the rendered chart has %d of the init Jobs' Role and ClusterRole gpupool-init, want both", found)
	}
	return cp.kubeconfigFor(t, "system:serviceaccount:"+ns+":"+sa, "system:serviceaccounts", "system:serviceaccounts:"+ns)
}

// secretFiles writes a TLS Secret's ca.crt, tls.crt and tls.key into dir.
func secretFiles(t *testing.T, sec *corev1.Secret, dir string) pki.Files {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	f := pki.Files{CA: filepath.Join(dir, "ca.crt"), Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key")}
	for path, key := range map[string]string{f.CA: "ca.crt", f.Cert: "tls.crt", f.Key: "tls.key"} {
		if len(sec.Data[key]) == 0 {
			t.Fatalf("Secret %s has no %s", sec.Name, key)
		}
		if err := os.WriteFile(path, sec.Data[key], 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

func tlsArgs(f pki.Files) []string {
	return []string{"--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key}
}

func TestInitJobsMakeWorkingSecretsAndASecondRunChangesNothing(t *testing.T) {
	cp := sharedControlPlane(t)
	ns := cp.newNamespace(t)
	ctx := context.Background()
	kubeconfig := chartInitRBAC(t, cp, ns, "gpupool-init")
	env := []string{"POD_NAMESPACE=" + ns, "TMPDIR=" + t.TempDir()}
	sel := map[string]string{"gpupool.test/init": ns}
	pool := []string{ns + "-gpu-1", ns + "-gpu-2"}
	for _, n := range pool {
		cp.addNode(t, n, sel)
	}
	cp.addNode(t, ns+"-cpu-1", nil)

	// Bad input first: a usage error, and nothing made.
	if r := runInit(t, env, "operator", "k8s", "tls-init", "--kubeconfig", kubeconfig, "--prefix", "gp"); r.code != 2 || !strings.Contains(r.stderr, "broker-hosts") {
		t.Fatalf("tls-init without --broker-hosts: exit %d, %q; want 2 naming broker-hosts", r.code, r.stderr)
	}

	tlsInit := []string{"operator", "k8s", "tls-init", "--kubeconfig", kubeconfig, "--prefix", "gp", "--broker-hosts", "127.0.0.1,localhost"}
	if r := runInit(t, env, tlsInit...); r.code != 0 {
		t.Fatalf("tls-init: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	secret := func(name string) *corev1.Secret {
		t.Helper()
		s, err := cp.Client.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("Secret %s: %v", name, err)
		}
		return s
	}
	dir := shortTempDir(t)
	brokerTLS := secretFiles(t, secret("gp-broker-tls"), filepath.Join(dir, "broker-tls"))
	agentTLS := secretFiles(t, secret("gp-agent-tls"), filepath.Join(dir, "agent-tls"))
	clientTLS := secretFiles(t, secret("gp-client-tls"), filepath.Join(dir, "client-tls"))

	// A broker cluster with TLS and ACL on, from the Secrets.
	var addrs, raft []string
	for range 3 {
		addrs = append(addrs, mustFreePort(t))
		raft = append(raft, mustFreePort(t))
	}
	for i := range addrs {
		var join []string
		for j, a := range addrs {
			if j != i {
				join = append(join, a)
			}
		}
		id := fmt.Sprintf("broker-%d", i+1)
		startGpupool(t, "init-"+id, append([]string{"broker", "--node-id", id, "--data-dir", filepath.Join(dir, id),
			"--bind", addrs[i], "--raft-bind", raft[i], "--bootstrap-expect", "3", "--join", strings.Join(join, ",")}, tlsArgs(brokerTLS)...)...)
	}
	jobEnv := append(env, "GPUPOOL_ADDR="+strings.Join(addrs, ","),
		"GPUPOOL_TLS_CA="+clientTLS.CA, "GPUPOOL_TLS_CERT="+clientTLS.Cert, "GPUPOOL_TLS_KEY="+clientTLS.Key)
	aclInit := []string{"operator", "k8s", "acl-init", "--kubeconfig", kubeconfig, "--prefix", "gp",
		"--agent-node-selector", "gpupool.test/init=" + ns, "--wait", "2m"}
	if r := runInit(t, jobEnv, aclInit...); r.code != 0 {
		t.Fatalf("acl-init: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}

	// Every token is there and does what its name says.
	tokens, agentTokens := secret("gp-tokens"), secret("gp-agent-tokens")
	var agentKeys []string
	for k := range agentTokens.Data {
		agentKeys = append(agentKeys, k)
	}
	if len(agentKeys) != 2 || len(agentTokens.Data[pool[0]]) == 0 || len(agentTokens.Data[pool[1]]) == 0 {
		t.Errorf("agent tokens: got keys %v, want one per pool-host node %v (and none for %s-cpu-1)", agentKeys, pool, ns)
	}
	src, err := pki.NewSource(clientTLS, nil)
	if err != nil {
		t.Fatal(err)
	}
	whoami := func(secret []byte) *gpupoolv1.AclToken {
		t.Helper()
		c, err := client.DialWith(addrs, client.Options{TLS: src.ClientConfig(), Token: string(secret)})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		resp, err := gpupoolv1.NewAclServiceClient(c.Conn()).WhoAmI(cctx, &gpupoolv1.WhoAmIRequest{})
		if err != nil {
			t.Fatalf("whoami: %v", err)
		}
		return resp.GetToken()
	}
	for _, c := range []struct {
		what   string
		secret []byte
		kind   gpupoolv1.TokenKind
		tenant string
		host   string
	}{
		{"the bootstrap token", secret("gp-acl-bootstrap").Data["token"], gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT, "", ""},
		{"the controller's token", tokens.Data["controller"], gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, "k8s", ""},
		{"the node plugin's token", tokens.Data["node-plugin"], gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, "k8s", ""},
		{"the brokers' token", tokens.Data["broker"], gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT, "", ""},
		{"gpu-1's agent token", agentTokens.Data[pool[0]], gpupoolv1.TokenKind_TOKEN_KIND_AGENT, "", pool[0]},
	} {
		tok := whoami(c.secret)
		if tok.GetKind() != c.kind || (c.tenant != "" && (len(tok.GetTenants()) == 0 || tok.GetTenants()[0] != c.tenant)) || tok.GetHostId() != c.host {
			t.Errorf("%s: got kind %s tenants %v host %q, want %s tenant %q host %q", c.what, tok.GetKind(), tok.GetTenants(), tok.GetHostId(), c.kind, c.tenant, c.host)
		}
	}

	// An agent registers with its token from the Secret and the agent TLS Secret.
	tokenFile := filepath.Join(dir, "agent.token")
	if err := os.WriteFile(tokenFile, agentTokens.Data[pool[0]], 0o600); err != nil {
		t.Fatal(err)
	}
	startGpupool(t, "init-agent", append([]string{"agent", "--broker", strings.Join(addrs, ","), "--host-id", pool[0],
		"--simulate", "1xA100-80GB", "--mps", "off", "--token-file", tokenFile, "--data-dir", filepath.Join(dir, "agent"),
		"--data-bind", "127.0.0.1:0"}, tlsArgs(agentTLS)...)...)
	mgmt, err := client.DialWith(addrs, client.Options{TLS: src.ClientConfig(), Token: string(secret("gp-acl-bootstrap").Data["token"])})
	if err != nil {
		t.Fatal(err)
	}
	defer mgmt.Close()
	eventually(t, "the agent registered with its token", time.Minute, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		h, err := mgmt.Pool.GetHost(ctx, &gpupoolv1.GetHostRequest{HostId: pool[0]})
		if err != nil {
			return err
		}
		if h.GetHost().GetStatus() != gpupoolv1.HostStatus_HOST_STATUS_READY {
			return fmt.Errorf("host %s", h.GetHost().GetStatus())
		}
		return nil
	})

	// A second run of both changes nothing.
	versions := func() map[string]string {
		list, err := cp.Client.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, s := range list.Items {
			out[s.Name] = s.ResourceVersion
		}
		return out
	}
	before := versions()
	for _, want := range []string{"gp-ca", "gp-broker-tls", "gp-agent-tls", "gp-client-tls", "gp-acl-bootstrap", "gp-tokens", "gp-agent-tokens"} {
		if before[want] == "" {
			t.Errorf("Secret %s was not made", want)
		}
	}
	for _, args := range [][]string{tlsInit, aclInit} {
		r := runInit(t, jobEnv, args...)
		if r.code != 0 {
			t.Fatalf("second %s: exit %d\n%s%s", args[2], r.code, r.stdout, r.stderr)
		}
		if strings.Contains(r.stdout, "created") || strings.Contains(r.stdout, "bootstrapped") {
			t.Errorf("second %s made something:\n%s", args[2], r.stdout)
		}
	}
	after := versions()
	for name, v := range before {
		if after[name] != v {
			t.Errorf("Secret %s changed on the second run: resourceVersion %s, then %s", name, v, after[name])
		}
	}
}
