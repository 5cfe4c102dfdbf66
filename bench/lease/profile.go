package leasebench

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// profiler fetches Go profiles from the brokers (started with
// --pprof-bind) over a level's timed window: a CPU profile and the mutex
// and block contention recorded during it, one file each per broker.
type profiler struct {
	dir   string            // where the profiles go
	addrs map[string]string // broker name -> its --pprof-bind address
	// metrics are the brokers' --metrics-bind addresses: the Raft log
	// writes and applied entries of each over the window say how many
	// entries each fsync carried (group commit), reported through logf
	// and written to gpupool-CLIENTS-batching.txt.
	metrics map[string]string
	logf    func(format string, args ...any)
}

// profileKinds are the profiles taken of each broker, by the name
// net/http/pprof serves them under.
var profileKinds = []string{"profile", "mutex", "block"}

// start waits until from, then profiles every broker for d in the
// background; the returned wait blocks until every file is written and
// returns the first error.
func (p *profiler) start(ctx context.Context, from time.Time, d time.Duration, clients int) (wait func() error) {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	secs := max(int(d/time.Second), 1)
	for name, addr := range p.addrs {
		for _, kind := range profileKinds {
			wg.Go(func() {
				sleep(ctx, time.Until(from))
				url := fmt.Sprintf("http://%s/debug/pprof/%s?seconds=%d", addr, kind, secs)
				file := filepath.Join(p.dir, fmt.Sprintf("gpupool-%d-%s.%s.pprof", clients, name, kindFile(kind)))
				if err := fetchTo(ctx, url, file); err != nil {
					mu.Lock()
					if first == nil {
						first = fmt.Errorf("profile %s: %w", name, err)
					}
					mu.Unlock()
				}
			})
		}
	}
	if len(p.metrics) > 0 {
		wg.Go(func() {
			if err := p.batching(ctx, from, d, clients); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		})
	}
	return func() error {
		wg.Wait()
		return first
	}
}

// batching reads every broker's Raft log writes and applied index at the
// start and the end of the window and reports the entries per write.
func (p *profiler) batching(ctx context.Context, from time.Time, d time.Duration, clients int) error {
	read := func() (map[string][2]float64, error) {
		out := map[string][2]float64{}
		for name, addr := range p.metrics {
			writes, applied, err := scrapeRaft(ctx, "http://"+addr+"/metrics")
			if err != nil {
				return nil, fmt.Errorf("metrics of %s: %w", name, err)
			}
			out[name] = [2]float64{writes, applied}
		}
		return out, nil
	}
	sleep(ctx, time.Until(from))
	before, err := read()
	if err != nil {
		return err
	}
	sleep(ctx, d)
	after, err := read()
	if err != nil {
		return err
	}
	var b strings.Builder
	names := slices.Sorted(maps.Keys(after))
	for _, name := range names {
		w := after[name][0] - before[name][0]
		e := after[name][1] - before[name][1]
		per := 0.0
		if w > 0 {
			per = e / w
		}
		fmt.Fprintf(&b, "%s: %.0f Raft log writes, %.0f entries applied, %.2f entries per write\n", name, w, e, per)
	}
	if p.logf != nil {
		for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
			p.logf("%d clients, group commit: %s", clients, line)
		}
	}
	return os.WriteFile(filepath.Join(p.dir, fmt.Sprintf("gpupool-%d-batching.txt", clients)), []byte(b.String()), 0o644)
}

// scrapeRaft returns a broker's count of Raft log writes and its applied
// index from its Prometheus metrics.
func scrapeRaft(ctx context.Context, url string) (writes, applied float64, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(body), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		v, perr := strconv.ParseFloat(f[1], 64)
		if perr != nil {
			continue
		}
		switch f[0] {
		case "gpupool_raft_log_write_seconds_count":
			writes = v
		case "gpupool_raft_applied_index":
			applied = v
		}
	}
	return writes, applied, nil
}

// kindFile names a profile kind in a file name.
func kindFile(kind string) string {
	if kind == "profile" {
		return "cpu"
	}
	return kind
}

// fetchTo writes the body of a GET of url to file.
func fetchTo(ctx context.Context, url, file string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, b)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
