package k8s

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/restmapper"
)

// chartRenderedEnv names the rendered chart (`make chart` writes it to
// .bin/chart-rendered.yaml; `make test-k8s` passes its path). Without it
// the test runs `make chart` itself.
const chartRenderedEnv = "GPUPOOL_CHART_RENDERED"

// chartExamples are the example manifests, relative to this package.
const chartExamples = "../../deploy/examples/*.yaml"

// TestChart checks the chart and examples against the real
// apiserver: every object of the rendered Helm chart and of
// deploy/examples decodes (strictly, with client-go's scheme) and is
// accepted by a server-side dry-run create with strict field validation,
// so the apiserver runs its decoding, defaulting, validation (CEL
// selectors and their cost included) and admission on exactly what the
// files say, and persists nothing. Namespaced objects of the chart go in
// its release namespace, created for the test; those of the examples,
// which name none, in the test's namespace.
func TestChart(t *testing.T) {
	rendered := chartRendered(t)
	cp := sharedControlPlane(t)
	v := newChartValidator(t, cp)
	ns := cp.newNamespace(t)

	objs, err := decodeManifestFile(rendered)
	if err != nil {
		t.Error(err) // and check what did decode
	}
	if len(objs) == 0 {
		t.Fatalf("%s: no objects: did the chart render?", rendered)
	}
	// The chart must hold what it must hold, lest an empty or
	// half-rendered chart pass vacuously.
	var kinds []string
	for _, o := range objs {
		kinds = append(kinds, o.id())
	}
	for _, want := range []string{
		"StatefulSet/gpupool-broker", "DaemonSet/gpupool-agent", "Deployment/gpupool-controller",
		"DaemonSet/gpupool-node-plugin", "DeviceClass/" + driverName,
		"ClusterRole/gpupool-controller", "ClusterRoleBinding/gpupool-controller",
	} {
		if !slices.Contains(kinds, want) {
			t.Errorf("%s: no %s among %v", rendered, want, kinds)
		}
	}
	made := map[string]bool{}
	for i := range objs {
		if _, err := v.mapping(&objs[i]); err != nil {
			t.Error(err) // and again in its subtest
			continue
		}
		if ns := objs[i].obj.GetNamespace(); objs[i].namespaced && ns != "" && !made[ns] {
			cp.ensureChartNamespace(t, ns)
			made[ns] = true
		}
	}

	examples, err := filepath.Glob(chartExamples)
	if err != nil {
		t.Fatal(err)
	}
	if len(examples) == 0 {
		t.Fatalf("no examples match %s", chartExamples)
	}
	for _, f := range examples {
		eobjs, err := decodeManifestFile(f)
		if err != nil {
			t.Error(err)
		}
		if len(eobjs) == 0 && err == nil {
			t.Errorf("%s: no objects", f)
		}
		objs = append(objs, eobjs...)
	}

	for _, o := range objs {
		t.Run(o.id(), func(t *testing.T) {
			if err := v.dryRun(t, o, ns); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestChartRefusesBrokenObjects checks that TestChart's check can fail: a
// deliberately broken object is refused, locally or by the apiserver, with
// a message that names the file, the object and the offending field.
func TestChartRefusesBrokenObjects(t *testing.T) {
	cp := sharedControlPlane(t)
	v := newChartValidator(t, cp)
	ns := cp.newNamespace(t)

	for _, tc := range []struct {
		name, manifest string
		// local: strict decoding with client-go's scheme must fail already;
		// the apiserver is then asked all the same, on the unstructured
		// object, to show that it refuses it on its own.
		local bool
		// want are substrings of the error.
		want []string
	}{{
		name: "unknown field",
		manifest: `apiVersion: apps/v1
kind: Deployment
metadata:
  name: typo
spec:
  selector:
    matchLabels: {app: typo}
  template:
    metadata:
      labels: {app: typo}
    spec:
      containers:
        - name: main
          image: registry.k8s.io/pause:3.10
          imagePullPolizy: Always
`,
		local: true,
		want:  []string{"Deployment/typo", `unknown field "spec.template.spec.containers[0].imagePullPolizy"`},
	}, {
		name: "invalid DeviceClass selector",
		manifest: `apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: broken.gpupool.dev
spec:
  selectors:
    - cel:
        expression: device.driver ==
`,
		want: []string{"DeviceClass/broken.gpupool.dev", "spec.selectors[0].cel.expression", "compilation failed"},
	}, {
		name: "DeviceClass selector of the wrong type",
		manifest: `apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: broken-type.gpupool.dev
spec:
  selectors:
    - cel:
        expression: device.driver
`,
		want: []string{"DeviceClass/broken-type.gpupool.dev", "spec.selectors[0].cel.expression", "must evaluate to bool"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "broken.yaml")
			if err := os.WriteFile(file, []byte(tc.manifest), 0o644); err != nil {
				t.Fatal(err)
			}
			objs, err := decodeManifestFile(file)
			switch {
			case tc.local && err == nil:
				t.Fatalf("%s decoded without error, want a strict decoding error", file)
			case tc.local:
				t.Logf("refused locally: %v", err)
				checkChartError(t, err, append([]string{file}, tc.want...))
				if objs, err = decodeManifestFileLoose(file); err != nil {
					t.Fatal(err)
				}
			case err != nil:
				t.Fatal(err)
			}
			if len(objs) != 1 {
				t.Fatalf("%s: %d objects, want 1", file, len(objs))
			}
			err = v.dryRun(t, objs[0], ns)
			if err == nil {
				t.Fatalf("the apiserver accepted %s", objs[0].id())
			}
			t.Logf("apiserver: %v", err)
			if !apierrors.IsBadRequest(err) && !apierrors.IsInvalid(err) {
				t.Errorf("got %v (reason %s), want BadRequest or Invalid", err, apierrors.ReasonForError(err))
			}
			checkChartError(t, err, append([]string{file}, tc.want...))
		})
	}
}

func checkChartError(t *testing.T, err error, want []string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not say %q", err, w)
		}
	}
}

// chartRendered returns the path of the rendered chart: $GPUPOOL_CHART_RENDERED,
// else what `make chart` renders, which it then runs (building the pinned
// helm once, into .bin).
func chartRendered(t *testing.T) string {
	t.Helper()
	if p := os.Getenv(chartRenderedEnv); p != "" {
		return p
	}
	start := time.Now()
	cmd := exec.Command("make", "-C", filepath.Join("..", ".."), "chart")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s is not set and `make -C ../.. chart` failed: %v\n%s", chartRenderedEnv, err, out)
	}
	t.Logf("%s is not set: ran `make chart` (%s)", chartRenderedEnv, time.Since(start).Round(time.Millisecond))
	return filepath.Join("..", "..", ".bin", "chart-rendered.yaml")
}

// manifestObject is one document of a manifest file.
type manifestObject struct {
	file string // as given to decodeManifestFile
	doc  int    // 1-based document number in the file
	obj  *unstructured.Unstructured
	// namespaced is filled in by chartValidator.mapping.
	namespaced bool
}

// id is "Kind/name", the subtest's name.
func (o manifestObject) id() string { return o.obj.GetKind() + "/" + o.obj.GetName() }

// where names the object and its place for error messages.
func (o manifestObject) where() string {
	return fmt.Sprintf("%s (document %d of %s)", o.id(), o.doc, o.file)
}

// strictDecoder is client-go's universal deserializer (every built-in API
// group and version the apiserver serves, incl. resource.k8s.io/v1),
// strict: unknown and duplicate fields are errors.
var strictDecoder = serializer.NewCodecFactory(scheme.Scheme, serializer.EnableStrict).UniversalDeserializer()

// decodeManifestFile decodes every YAML document of file, skipping empty
// ones, as unstructured objects, and checks that each decodes strictly
// into its Go type too. It returns the objects that decoded and an error
// for those that did not, each naming the file, the document and, when it
// has one, the object.
func decodeManifestFile(file string) ([]manifestObject, error) {
	return decodeManifests(file, true)
}

// decodeManifestFileLoose is decodeManifestFile without the strict typed
// decoding, to hand a broken object to the apiserver.
func decodeManifestFileLoose(file string) ([]manifestObject, error) {
	return decodeManifests(file, false)
}

func decodeManifests(file string, strict bool) ([]manifestObject, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []manifestObject
	var errs []error
	for doc := 1; ; doc++ {
		raw, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, errors.Join(errs...)
		}
		if err != nil {
			return objs, errors.Join(append(errs, fmt.Errorf("%s: document %d: %w", file, doc, err))...)
		}
		js, err := utilyaml.ToJSON(raw)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: document %d: not YAML: %w", file, doc, err))
			continue
		}
		if t := bytes.TrimSpace(js); len(t) == 0 || string(t) == "null" {
			continue // only comments, or nothing
		}
		u := &unstructured.Unstructured{}
		if _, _, err := unstructured.UnstructuredJSONScheme.Decode(js, nil, u); err != nil {
			errs = append(errs, fmt.Errorf("%s: document %d: %w", file, doc, err))
			continue
		}
		o := manifestObject{file: file, doc: doc, obj: u}
		if u.GetName() == "" {
			errs = append(errs, fmt.Errorf("%s: no metadata.name", o.where()))
			continue
		}
		if strict {
			typed, gvk, err := strictDecoder.Decode(raw, nil, nil)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", o.where(), err))
				continue
			}
			if _, ok := typed.(runtime.Unstructured); ok || gvk == nil || *gvk != u.GroupVersionKind() {
				errs = append(errs, fmt.Errorf("%s: decoded as %v, want %v", o.where(), gvk, u.GroupVersionKind()))
				continue
			}
		}
		objs = append(objs, o)
	}
}

// chartValidator creates objects of any kind with a server-side dry run.
type chartValidator struct {
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

func newChartValidator(t *testing.T, cp *controlPlane) *chartValidator {
	t.Helper()
	dc, err := discovery.NewDiscoveryClientForConfig(cp.Config)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cp.Config)
	if err != nil {
		t.Fatal(err)
	}
	return &chartValidator{dyn: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))}
}

// mapping finds o's resource, and whether it is namespaced.
func (v *chartValidator) mapping(o *manifestObject) (*meta.RESTMapping, error) {
	gvk := o.obj.GroupVersionKind()
	m, err := v.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if meta.IsNoMatchError(err) {
		v.mapper.Reset() // discovery is cached: ask again once
		m, err = v.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: the apiserver serves no %s: %w", o.where(), gvk, err)
	}
	o.namespaced = m.Scope.Name() == meta.RESTScopeNameNamespace
	return m, nil
}

// dryRun creates o with DryRun=All and strict field validation, in its own
// namespace or else in ns. An object that exists already (the
// DeviceClass, which other tests create) is updated instead, also as a dry
// run, so that it is validated all the same.
func (v *chartValidator) dryRun(t *testing.T, o manifestObject, ns string) error {
	t.Helper()
	m, err := v.mapping(&o)
	if err != nil {
		return err
	}
	obj := o.obj.DeepCopy()
	var ri dynamic.ResourceInterface = v.dyn.Resource(m.Resource)
	switch {
	case o.namespaced:
		if obj.GetNamespace() == "" {
			obj.SetNamespace(ns)
		}
		ri = v.dyn.Resource(m.Resource).Namespace(obj.GetNamespace())
	case obj.GetNamespace() != "":
		return fmt.Errorf("%s: cluster-scoped, yet metadata.namespace is %q", o.where(), obj.GetNamespace())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = ri.Create(ctx, obj, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: metav1.FieldValidationStrict})
	if apierrors.IsAlreadyExists(err) {
		cur, gerr := ri.Get(ctx, obj.GetName(), metav1.GetOptions{})
		if gerr != nil {
			return fmt.Errorf("%s: exists, and get: %w", o.where(), gerr)
		}
		t.Logf("%s exists: validating it as a dry-run update instead", o.id())
		obj.SetResourceVersion(cur.GetResourceVersion())
		_, err = ri.Update(ctx, obj, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: metav1.FieldValidationStrict})
	}
	if err != nil {
		return fmt.Errorf("%s: refused by the apiserver: %w", o.where(), err)
	}
	return nil
}

// ensureChartNamespace creates the namespace name unless it exists, and
// deletes it when t ends if it created it. One still being deleted (by an
// earlier run in this test binary) is waited for first: nothing can be
// created in it.
func (cp *controlPlane) ensureChartNamespace(t *testing.T, name string) {
	t.Helper()
	namespaces := cp.Client.CoreV1().Namespaces()
	created := false
	eventually(t, "namespace "+name, time.Minute, func(ctx context.Context) error {
		ns, err := namespaces.Get(ctx, name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			_, err = namespaces.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
			created = err == nil
			return err
		case err != nil:
			return err
		case ns.DeletionTimestamp != nil:
			return fmt.Errorf("namespace %s is being deleted", name)
		}
		return nil
	})
	if !created {
		return
	}
	t.Cleanup(func() {
		err := namespaces.Delete(context.Background(), name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete namespace %s: %v", name, err)
		}
	})
}
