package k8s

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestChartSchemaRefusesMisspelledDeviceClassSelectors renders the chart
// with deviceClass.extra values: a selector on an attribute the driver
// does not publish (a misspelling would select nothing), or with an
// unknown operator, is refused by values.schema.json, naming the field and
// the allowed values; a correct one renders.
func TestChartSchemaRefusesMisspelledDeviceClassSelectors(t *testing.T) {
	root := filepath.Join("..", "..")
	if out, err := exec.Command("make", "-C", root, "helm").CombinedOutput(); err != nil {
		t.Fatalf("make helm: %v\n%s", err, out)
	}
	helm := filepath.Join(root, ".bin", "helm")
	for _, tc := range []struct {
		name, values string
		want         []string // "" for a clean render
	}{
		{"a known attribute renders", `deviceClass:
  extra:
    - name: a100.gpupool.dev
      match:
        - attribute: model
          startsWith: A100
`, nil},
		{"a misspelled attribute is refused", `deviceClass:
  extra:
    - name: a100.gpupool.dev
      match:
        - attribute: modle
          startsWith: A100
`, []string{"attribute", "model", "pcieRoot"}},
		{"an unknown operator is refused", `deviceClass:
  extra:
    - name: a100.gpupool.dev
      match:
        - attribute: model
          matches: A100.*
`, []string{"match", "matches"}},
		{"a bad extended resource name is refused", `deviceClass:
  extendedResourceName: gpu
`, []string{"extendedResourceName"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "values.yaml")
			if err := os.WriteFile(file, []byte(tc.values), 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command(helm, "template", "gpupool", filepath.Join(root, "deploy", "helm", "gpupool"), "-f", file).CombinedOutput()
			if tc.want == nil {
				if err != nil {
					t.Fatalf("helm template: %v\n%s", err, out)
				}
				if !strings.Contains(string(out), `device.attributes[\"gpu.gpupool.dev\"].?model.orValue(\"\").startsWith(\"A100\")`) {
					t.Errorf("rendered chart has no selector on model:\n%s", out)
				}
				return
			}
			if err == nil {
				t.Fatalf("helm template accepted the values:\n%s", tc.values)
			}
			for _, w := range tc.want {
				if !strings.Contains(string(out), w) {
					t.Errorf("helm's refusal does not say %q:\n%s", w, out)
				}
			}
		})
	}
}
