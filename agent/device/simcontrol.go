package device

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"reflect"
	"strings"
	"time"
)

// The control API of a simulated agent: one POST endpoint per Simulator
// method, each taking a JSON object whose fields are all required, and
// answering 204 No Content, or an error status with a simControlError.
const (
	simPathProcess     = "/v1/process"     // simProcessRequest
	simPathUtilization = "/v1/utilization" // simUtilizationRequest
	simPathXid         = "/v1/xid"         // simXidRequest
	simPathECC         = "/v1/ecc"         // simECCRequest
	simPathLost        = "/v1/lost"        // an empty body or {}
)

// maxSimRequestBytes bounds a control request's body; the largest valid
// one is under 100 bytes.
const maxSimRequestBytes = 4 << 10

// simControlTimeout bounds a control request, on both sides.
const simControlTimeout = 10 * time.Second

type simProcessRequest struct {
	Device  *int   `json:"device"`
	PID     *int   `json:"pid"`
	UsedMiB *int64 `json:"used_mib"`
}

type simUtilizationRequest struct {
	Device  *int `json:"device"`
	Percent *int `json:"percent"`
}

type simXidRequest struct {
	Device *int    `json:"device"`
	Xid    *uint64 `json:"xid"`
}

type simECCRequest struct {
	Device    *int  `json:"device"`
	DoubleBit *bool `json:"double_bit"`
}

type simLostRequest struct{}

// simControlError is the body of every error answer.
type simControlError struct {
	Error string `json:"error"`
}

// ServeSimControl serves sim's control API on a unix socket at path until
// ctx ends, then returns nil; it returns an error if it cannot listen. It
// replaces a stale socket at path, but refuses to replace anything else
// or a socket another process serves. The socket is only for its owner
// (mode 0600, set just after it is created, so keep it in a directory
// only the owner can enter) and is removed on return.
// Tests drive a simulated agent running as another process through it,
// with DialSimControl.
//
// Each endpoint (POST /v1/process, /v1/utilization, /v1/xid, /v1/ecc,
// /v1/lost) takes a JSON object with the arguments of the Simulator
// method of the same name, all required, in snake case: {"device": 0,
// "pid": 123, "used_mib": 4096}. It answers 204 No Content when the
// method succeeds, or 400 with {"error": "..."} naming the bad field, or
// relaying the method's error.
func ServeSimControl(ctx context.Context, path string, sim Simulator) error {
	if err := removeStaleSocket(path); err != nil {
		return err
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("device: simulator control socket: %w", err)
	}
	// The listener removes the socket file when closed.
	if err := os.Chmod(path, 0o600); err != nil {
		_ = l.Close()
		return fmt.Errorf("device: simulator control socket: %w", err)
	}
	srv := &http.Server{
		Handler:           newSimControlHandler(sim),
		ReadHeaderTimeout: simControlTimeout,
		ReadTimeout:       simControlTimeout,
		WriteTimeout:      simControlTimeout,
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(l) }()
	select {
	case err := <-done:
		_ = l.Close()
		return fmt.Errorf("device: simulator control socket: %w", err)
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), simControlTimeout)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		_ = srv.Close()
	}
	<-done
	return nil
}

// removeStaleSocket removes the unix socket at path, if there is one, and
// refuses to remove anything else.
func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return fmt.Errorf("device: simulator control socket: %w", err)
	case fi.Mode().Type() != fs.ModeSocket:
		return fmt.Errorf("device: simulator control socket %s: exists and is not a socket", path)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		_ = c.Close()
		return fmt.Errorf("device: simulator control socket %s: another process serves it", path)
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("device: simulator control socket: remove stale socket: %w", err)
	}
	return nil
}

// newSimControlHandler serves sim's control API.
func newSimControlHandler(sim Simulator) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST "+simPathProcess, simEndpoint(func(r simProcessRequest) error {
		return sim.SetProcess(*r.Device, *r.PID, *r.UsedMiB)
	}))
	mux.Handle("POST "+simPathUtilization, simEndpoint(func(r simUtilizationRequest) error {
		return sim.SetUtilization(*r.Device, *r.Percent)
	}))
	mux.Handle("POST "+simPathXid, simEndpoint(func(r simXidRequest) error {
		return sim.InjectXid(*r.Device, *r.Xid)
	}))
	mux.Handle("POST "+simPathECC, simEndpoint(func(r simECCRequest) error {
		return sim.InjectECC(*r.Device, *r.DoubleBit)
	}))
	mux.Handle("POST "+simPathLost, simEndpoint(func(simLostRequest) error {
		return sim.LoseGPUs()
	}))
	return mux
}

// simEndpoint decodes a request of type R and applies it.
func simEndpoint[R any](apply func(R) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req R
		err := decodeSimRequest(http.MaxBytesReader(w, r.Body, maxSimRequestBytes), &req)
		if tooLarge, ok := errors.AsType[*http.MaxBytesError](err); ok {
			writeSimError(w, http.StatusRequestEntityTooLarge, fmt.Errorf("request body: more than %d bytes", tooLarge.Limit))
			return
		}
		if err != nil {
			writeSimError(w, http.StatusBadRequest, err)
			return
		}
		if err := apply(req); err != nil {
			writeSimError(w, http.StatusBadRequest, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

func writeSimError(w http.ResponseWriter, status int, err error) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(simControlError{Error: err.Error()})
}

// decodeSimRequest decodes one JSON object from body into req, a pointer
// to a struct of pointer fields, every one of which it must set. An empty
// body is an empty object. Errors name the offending field.
func decodeSimRequest(body io.Reader, req any) error {
	b, err := io.ReadAll(body)
	if err != nil {
		return err
	}
	if len(bytes.TrimSpace(b)) == 0 {
		b = []byte("{}")
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(req); err != nil {
		return describeJSONError(err, req)
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("bad JSON: want one object and nothing after it")
	}
	v := reflect.ValueOf(req).Elem()
	for i := range v.NumField() {
		if v.Field(i).IsNil() {
			return fmt.Errorf("field %q: missing; want %s", jsonName(v.Type().Field(i)), fieldList(req))
		}
	}
	return nil
}

// describeJSONError rewords a decoding error of req to name the field
// and what it takes.
func describeJSONError(err error, req any) error {
	if typeErr, ok := errors.AsType[*json.UnmarshalTypeError](err); ok {
		if typeErr.Field == "" {
			return fmt.Errorf("bad JSON: want an object, got %s", typeErr.Value)
		}
		return fmt.Errorf("field %q: %s is not %s", typeErr.Field, typeErr.Value, jsonKind(typeErr.Type))
	}
	if syntaxErr, ok := errors.AsType[*json.SyntaxError](err); ok {
		return fmt.Errorf("bad JSON at byte %d: %v", syntaxErr.Offset, err)
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return errors.New("bad JSON: the object is cut short")
	}
	if field, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		want := fieldList(req)
		if want == "" {
			want = "none"
		}
		return fmt.Errorf("field %s: unknown; want %s", field, want)
	}
	return fmt.Errorf("bad JSON: %w", err)
}

// jsonKind says what a Go type takes in JSON.
func jsonKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Int, reflect.Int64:
		return "an integer"
	case reflect.Uint64:
		return "an integer of 0 or more"
	case reflect.Bool:
		return "true or false"
	default:
		return "a " + t.Kind().String()
	}
}

func jsonName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
	return name
}

// fieldList lists the JSON fields of req, a pointer to a struct.
func fieldList(req any) string {
	t := reflect.TypeOf(req).Elem()
	names := make([]string, t.NumField())
	for i := range names {
		names[i] = jsonName(t.Field(i))
	}
	return strings.Join(names, ", ")
}

// SimClient drives a simulated agent through its control socket (see
// ServeSimControl). Its methods are those of Simulator, and fail with the
// agent's message when the simulator refuses a call. It is safe for
// concurrent use.
type SimClient struct {
	http *http.Client
}

var _ Simulator = (*SimClient)(nil)

// DialSimControl returns a client of the control socket at path. It
// connects on each call, so the agent may start after it.
func DialSimControl(path string) *SimClient {
	return &SimClient{http: &http.Client{
		Timeout: simControlTimeout,
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", path)
			},
			DisableKeepAlives: true,
		},
	}}
}

func (c *SimClient) SetProcess(device, pid int, usedMiB int64) error {
	return c.post(simPathProcess, simProcessRequest{Device: &device, PID: &pid, UsedMiB: &usedMiB})
}

func (c *SimClient) SetUtilization(device, percent int) error {
	return c.post(simPathUtilization, simUtilizationRequest{Device: &device, Percent: &percent})
}

func (c *SimClient) InjectXid(device int, xid uint64) error {
	return c.post(simPathXid, simXidRequest{Device: &device, Xid: &xid})
}

func (c *SimClient) InjectECC(device int, doubleBit bool) error {
	return c.post(simPathECC, simECCRequest{Device: &device, DoubleBit: &doubleBit})
}

func (c *SimClient) LoseGPUs() error {
	return c.post(simPathLost, simLostRequest{})
}

// post sends req to the endpoint at path.
func (c *SimClient) post(path string, req any) error {
	body, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("device: simulator control %s: %w", path, err)
	}
	// The host is ignored: the transport dials the socket.
	resp, err := c.http.Post("http://simulator"+path, "application/json", bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("device: simulator control %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNoContent {
		return nil
	}
	var e simControlError
	b, _ := io.ReadAll(io.LimitReader(resp.Body, maxSimRequestBytes))
	if json.Unmarshal(b, &e) != nil || e.Error == "" {
		return fmt.Errorf("device: simulator control %s: %s", path, resp.Status)
	}
	return errors.New(e.Error)
}
