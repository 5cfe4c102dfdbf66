package leasebench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// profiler fetches Go profiles from the brokers (started with
// --pprof-bind) over a level's timed window: a CPU profile and the mutex
// and block contention recorded during it, one file each per broker.
type profiler struct {
	dir   string            // where the profiles go
	addrs map[string]string // broker name -> its --pprof-bind address
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
	return func() error {
		wg.Wait()
		return first
	}
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
