package device

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// serveSim serves sim's control API on a socket in a fresh directory
// until the test ends, and returns the socket's path.
func serveSim(t *testing.T, sim Simulator) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "sim.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeSimControl(ctx, path, sim) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("ServeSimControl: %v", err)
			}
		case <-time.After(waitLimit):
			t.Errorf("ServeSimControl did not return within %v of its context ending", waitLimit)
		}
		if _, err := os.Lstat(path); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("socket %s still there after ServeSimControl returned: %v", path, err)
		}
	})
	waitFor(t, "the control socket is up", func() bool {
		c, err := net.Dial("unix", path)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	})
	return path
}

func TestSimControlRoundTrip(t *testing.T) {
	b := newSim(t, "2xA100-80GB")
	ids := uuids(simDevices(t, "2xA100-80GB", "host-a"))
	c := DialSimControl(serveSim(t, b))
	w := watch(t, b)

	if err := firstErr(c.SetProcess(1, 4242, 4096), c.SetProcess(1, 17, 1024), c.SetUtilization(1, 88)); err != nil {
		t.Fatal(err)
	}
	want := []Sample{
		{UUID: ids[0], Index: 0, MemoryUsedMiB: 0, UtilizationPercent: 0, Processes: []Process{}},
		{UUID: ids[1], Index: 1, MemoryUsedMiB: 5120, UtilizationPercent: 88, Processes: []Process{{17, 1024}, {4242, 4096}}},
	}
	if got := mustSample(t, b); !reflect.DeepEqual(got, want) {
		t.Errorf("Sample =\n%+v\nwant\n%+v", got, want)
	}

	for _, tc := range []struct {
		call func() error
		want HealthEvent
	}{
		{func() error { return c.InjectXid(0, 79) }, HealthEvent{UUID: ids[0], Kind: HealthXid, Xid: 79, Critical: true, Reason: "Xid 79"}},
		{func() error { return c.InjectECC(1, false) }, HealthEvent{UUID: ids[1], Kind: HealthECC, Reason: "single-bit ECC error"}},
		{func() error { return c.InjectECC(1, true) }, HealthEvent{UUID: ids[1], Kind: HealthECC, Critical: true, Reason: "double-bit ECC error"}},
		{c.LoseGPUs, HealthEvent{Kind: HealthLost, Critical: true, Reason: "GPU is lost"}},
	} {
		if err := tc.call(); err != nil {
			t.Fatal(err)
		}
		if got := w.next(t); got != tc.want {
			t.Errorf("got %+v, want %+v", got, tc.want)
		}
	}
	if s := mustSample(t, b); !s[0].Lost || !s[1].Lost {
		t.Errorf("Sample after LoseGPUs = %+v, want every GPU lost", s)
	}
}

func TestSimControlRelaysSimulatorErrors(t *testing.T) {
	c := DialSimControl(serveSim(t, newSim(t, "8xA100-80GB")))
	for _, tc := range simulatorRefusals {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.call(c); err == nil || err.Error() != tc.wantErr {
				t.Errorf("error = %v, want %s", err, tc.wantErr)
			}
		})
	}
}

func TestSimClientWithoutAServerFails(t *testing.T) {
	c := DialSimControl(filepath.Join(t.TempDir(), "none.sock"))
	if err := c.LoseGPUs(); err == nil || !strings.Contains(err.Error(), "device: simulator control /v1/lost:") {
		t.Errorf("error = %v, want one saying the control socket cannot be reached", err)
	}
}

// fakeSim records the calls a control API makes.
type fakeSim struct {
	mu    sync.Mutex
	calls []string
}

func (f *fakeSim) record(method string, args ...any) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fmtCall(method, args...))
	return nil
}

// fmtCall writes a call as its method and its arguments in JSON.
func fmtCall(method string, args ...any) string {
	b, _ := json.Marshal(append([]any{}, args...))
	return method + string(b)
}

func (f *fakeSim) SetProcess(device, pid int, usedMiB int64) error {
	return f.record("SetProcess", device, pid, usedMiB)
}
func (f *fakeSim) SetUtilization(device, percent int) error {
	return f.record("SetUtilization", device, percent)
}
func (f *fakeSim) InjectXid(device int, xid uint64) error { return f.record("InjectXid", device, xid) }
func (f *fakeSim) InjectECC(device int, doubleBit bool) error {
	return f.record("InjectECC", device, doubleBit)
}
func (f *fakeSim) LoseGPUs() error { return f.record("LoseGPUs") }

// post sends body to the control API of sim without a socket.
func post(h http.Handler, method, path, body string) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(method, path, strings.NewReader(body)))
	return rec
}

func TestSimControlRequests(t *testing.T) {
	for _, tc := range []struct {
		name, method, path, body string
		wantStatus               int
		wantCall                 string // "" for none
		wantErr                  string // the error field of the answer
	}{
		{"a process", "POST", "/v1/process", `{"device":1,"pid":123,"used_mib":4096}`, 204, `SetProcess[1,123,4096]`, ""},
		{"utilisation", "POST", "/v1/utilization", `{"device":0,"percent":50}`, 204, `SetUtilization[0,50]`, ""},
		{"an Xid", "POST", "/v1/xid", `{"device":2,"xid":79}`, 204, `InjectXid[2,79]`, ""},
		{"an ECC error", "POST", "/v1/ecc", `{"device":3,"double_bit":true}`, 204, `InjectECC[3,true]`, ""},
		{"lost GPUs with no body", "POST", "/v1/lost", ``, 204, `LoseGPUs[]`, ""},
		{"lost GPUs with an empty object", "POST", "/v1/lost", `{}`, 204, `LoseGPUs[]`, ""},
		{"an unknown field", "POST", "/v1/process", `{"device":1,"pid":2,"used_mib":3,"gpu":4}`, 400, "",
			`field "gpu": unknown; want device, pid, used_mib`},
		{"a field of lost GPUs", "POST", "/v1/lost", `{"device":0}`, 400, "", `field "device": unknown; want none`},
		{"a missing field", "POST", "/v1/process", `{"device":1,"pid":2}`, 400, "",
			`field "used_mib": missing; want device, pid, used_mib`},
		{"a string for a number", "POST", "/v1/utilization", `{"device":"0","percent":50}`, 400, "",
			`field "device": string is not an integer`},
		{"a fraction for a number", "POST", "/v1/process", `{"device":0,"pid":1.5,"used_mib":1}`, 400, "",
			`field "pid": number 1.5 is not an integer`},
		{"a negative Xid", "POST", "/v1/xid", `{"device":0,"xid":-1}`, 400, "",
			`field "xid": number -1 is not an integer of 0 or more`},
		{"a number for a bool", "POST", "/v1/ecc", `{"device":0,"double_bit":1}`, 400, "",
			`field "double_bit": number is not true or false`},
		{"bad JSON", "POST", "/v1/xid", `{"device":0,`, 400, "", `bad JSON: the object is cut short`},
		{"not JSON", "POST", "/v1/xid", `device=0`, 400, "", `bad JSON at byte 1: invalid character 'd' looking for beginning of value`},
		{"not an object", "POST", "/v1/xid", `[0, 79]`, 400, "", `bad JSON: want an object, got array`},
		{"two objects", "POST", "/v1/xid", `{"device":0,"xid":79}{}`, 400, "", `bad JSON: want one object and nothing after it`},
		{"a body that is too large", "POST", "/v1/lost", `{"device":"` + strings.Repeat("x", maxSimRequestBytes) + `"}`, 413, "",
			`request body: more than 4096 bytes`},
		{"another method", "GET", "/v1/process", ``, 405, "", ""},
		{"an unknown path", "POST", "/v1/reboot", `{}`, 404, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sim := &fakeSim{}
			rec := post(newSimControlHandler(sim), tc.method, tc.path, tc.body)
			if rec.Code != tc.wantStatus {
				t.Errorf("status = %d, want %d (body %s)", rec.Code, tc.wantStatus, rec.Body)
			}
			var wantCalls []string
			if tc.wantCall != "" {
				wantCalls = []string{tc.wantCall}
			}
			if !reflect.DeepEqual(sim.calls, wantCalls) {
				t.Errorf("simulator calls = %q, want %q", sim.calls, wantCalls)
			}
			if tc.wantErr != "" {
				var e simControlError
				if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error != tc.wantErr {
					t.Errorf("answer = %s, want error %q", rec.Body, tc.wantErr)
				}
			}
		})
	}
}

func TestServeSimControlReplacesOnlyAStaleSocket(t *testing.T) {
	dir := t.TempDir()
	stale := filepath.Join(dir, "stale.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	_ = l.Close()
	regular := filepath.Join(dir, "file")
	if err := os.WriteFile(regular, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	live := serveSim(t, &fakeSim{})

	ctx, cancel := context.WithCancel(context.Background())
	cancel() // each call returns once it has set up, or failed to
	for _, tc := range []struct {
		name, path, wantErr string
	}{
		{"a stale socket is replaced", stale, ""},
		{"a regular file is kept", regular, "device: simulator control socket " + regular + ": exists and is not a socket"},
		{"a socket another process serves is kept", live, "device: simulator control socket " + live + ": another process serves it"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ServeSimControl(ctx, tc.path, &fakeSim{})
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || err.Error() != tc.wantErr) {
				t.Errorf("ServeSimControl = %v, want %q", err, tc.wantErr)
			}
		})
	}
	if b, err := os.ReadFile(regular); err != nil || string(b) != "keep me" {
		t.Errorf("regular file = %q, %v; want it untouched", b, err)
	}
	if _, err := os.Lstat(stale); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("stale socket after serving on it: %v, want it removed", err)
	}
}

func TestSimControlSocketIsForItsOwnerOnly(t *testing.T) {
	fi, err := os.Lstat(serveSim(t, &fakeSim{}))
	if err != nil {
		t.Fatal(err)
	}
	if got := fi.Mode().Perm(); got != 0o600 {
		t.Errorf("socket mode = %v, want -rw-------", got)
	}
}

// The control API answers every body with 204 and one matching simulator
// call, or an error status, a JSON error and no call.
func FuzzSimControlProcess(f *testing.F) {
	for _, seed := range []string{
		`{"device":0,"pid":123,"used_mib":4096}`,
		`{"device":-1,"pid":0,"used_mib":-1}`,
		`{"device":0,"pid":1,"used_mib":1,"x":1}`,
		`{"device":1e3,"pid":1,"used_mib":1}`,
		`{"device":0}`,
		`{"device":0,"pid":1,"used_mib":1} {}`,
		`[]`,
		`null`,
		``,
		`{"DEVICE":0,"Pid":1,"used_MiB":1}`,
		`{"device":9223372036854775808,"pid":1,"used_mib":1}`,
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, body string) {
		sim := &fakeSim{}
		rec := post(newSimControlHandler(sim), "POST", simPathProcess, body)
		if rec.Code == http.StatusNoContent {
			var req struct {
				Device  int   `json:"device"`
				PID     int   `json:"pid"`
				UsedMiB int64 `json:"used_mib"`
			}
			if err := json.Unmarshal([]byte(body), &req); err != nil {
				t.Fatalf("accepted %q, which encoding/json refuses: %v", body, err)
			}
			want := []string{fmtCall("SetProcess", req.Device, req.PID, req.UsedMiB)}
			if !reflect.DeepEqual(sim.calls, want) {
				t.Fatalf("accepted %q with calls %q, want %q", body, sim.calls, want)
			}
			return
		}
		if rec.Code != http.StatusBadRequest && rec.Code != http.StatusRequestEntityTooLarge {
			t.Fatalf("status %d for %q, want 204, 400 or 413", rec.Code, body)
		}
		var e simControlError
		if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Error == "" {
			t.Fatalf("answer %q to %q is no JSON error", rec.Body, body)
		}
		if len(sim.calls) != 0 {
			t.Fatalf("refused %q but called %q", body, sim.calls)
		}
	})
}
