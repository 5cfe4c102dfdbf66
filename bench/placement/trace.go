package placement

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// node is one row of an openb node list: a host with gpus GPUs of one model.
type node struct {
	name     string
	cpu, mem int64
	gpus     int
	model    string
}

// task is one row of an openb pod list.
type task struct {
	name     string
	cpu, mem int64
	gpus     int    // 0 for a task without GPUs
	milli    int    // share of each GPU in thousandths
	spec     string // allowed models, "|"-separated; "" for any
	line     int    // in its file
}

// checkModels refuses a task of file whose gpu_spec names a model no node has, with its line.
func checkModels(file string, tasks []task, nodes []node) error {
	have := map[string]bool{}
	var models []string
	for _, n := range nodes {
		if n.model != "" && !have[n.model] {
			have[n.model] = true
			models = append(models, n.model)
		}
	}
	for _, t := range tasks {
		if t.spec == "" {
			continue
		}
		for _, m := range strings.Split(t.spec, "|") {
			if !have[m] {
				return fmt.Errorf("%s:%d: column gpu_spec: unknown model %q: the node list has %s", file, t.line, m, strings.Join(models, ", "))
			}
		}
	}
	return nil
}

// gpuMilli is the GPU capacity the task asks for, in thousandths of a GPU.
func (t *task) gpuMilli() int64 { return int64(t.gpus) * int64(t.milli) }

// table reads a CSV file with a header row and gives its rows as name → field, with each
// error naming the file and line.
type table struct {
	file string
	r    *csv.Reader
	col  map[string]int
	row  []string
	line int
}

func openTable(file string, data io.Reader, required ...string) (*table, error) {
	t := &table{file: file, r: csv.NewReader(data), col: map[string]int{}}
	t.r.ReuseRecord = true
	head, err := t.r.Read()
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%s:1: empty file: want a header row with %s", file, strings.Join(required, ","))
		}
		return nil, fmt.Errorf("%s:1: %w", file, err)
	}
	for i, h := range head {
		t.col[strings.TrimSpace(strings.TrimPrefix(h, "\ufeff"))] = i
	}
	var missing []string
	for _, c := range required {
		if _, ok := t.col[c]; !ok {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%s:1: missing column %s: the header must name %s", file,
			strings.Join(missing, ", "), strings.Join(required, ","))
	}
	return t, nil
}

// next reads the next row; it returns false at the end of the file.
func (t *table) next() (bool, error) {
	row, err := t.r.Read()
	if errors.Is(err, io.EOF) {
		return false, nil
	}
	t.line, _ = t.r.FieldPos(0)
	if err != nil {
		return false, fmt.Errorf("%s:%d: %w", t.file, t.line, err)
	}
	t.row = row
	return true, nil
}

// str is the field of column c, "" when the file has no such column.
func (t *table) str(c string) string {
	if i, ok := t.col[c]; ok {
		return strings.TrimSpace(t.row[i])
	}
	return ""
}

// num is the field of column c as an integer between lo and hi.
func (t *table) num(c string, lo, hi int64) (int64, error) {
	s := t.str(c)
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s:%d: column %s: %q is not a whole number", t.file, t.line, c, s)
	}
	if n < lo || n > hi {
		return 0, fmt.Errorf("%s:%d: column %s: %d: must be between %d and %d", t.file, t.line, c, n, lo, hi)
	}
	return n, nil
}

func readFile(file string, parse func(name string, r io.Reader) error) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	return parse(file, f)
}

// loadNodes reads an openb node list (sn,cpu_milli,memory_mib,gpu,model).
func loadNodes(file string) ([]node, error) {
	var nodes []node
	err := readFile(file, func(name string, r io.Reader) (err error) {
		nodes, err = parseNodes(name, r)
		return err
	})
	return nodes, err
}

func parseNodes(file string, r io.Reader) ([]node, error) {
	t, err := openTable(file, r, "sn", "cpu_milli", "memory_mib", "gpu", "model")
	if err != nil {
		return nil, err
	}
	var nodes []node
	for {
		ok, err := t.next()
		if err != nil || !ok {
			if err == nil && len(nodes) == 0 {
				err = fmt.Errorf("%s: no nodes", file)
			}
			return nodes, err
		}
		n := node{name: t.str("sn"), model: t.str("model")}
		var gpus int64
		if n.cpu, err = t.num("cpu_milli", 0, 1<<40); err != nil {
			return nil, err
		}
		if n.mem, err = t.num("memory_mib", 0, 1<<40); err != nil {
			return nil, err
		}
		if gpus, err = t.num("gpu", 0, 1024); err != nil {
			return nil, err
		}
		n.gpus = int(gpus)
		if n.name == "" {
			return nil, fmt.Errorf("%s:%d: column sn: empty: every node needs a name", file, t.line)
		}
		if n.gpus > 0 && n.model == "" {
			return nil, fmt.Errorf("%s:%d: column model: empty for a node with %d GPUs", file, t.line, n.gpus)
		}
		nodes = append(nodes, n)
	}
}

// loadTasks reads an openb pod list (name,cpu_milli,memory_mib,num_gpu,gpu_milli and an
// optional gpu_spec).
func loadTasks(file string) ([]task, error) {
	var tasks []task
	err := readFile(file, func(name string, r io.Reader) (err error) {
		tasks, err = parseTasks(name, r)
		return err
	})
	return tasks, err
}

func parseTasks(file string, r io.Reader) ([]task, error) {
	t, err := openTable(file, r, "name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
	if err != nil {
		return nil, err
	}
	var tasks []task
	for {
		ok, err := t.next()
		if err != nil || !ok {
			if err == nil && len(tasks) == 0 {
				err = fmt.Errorf("%s: no tasks", file)
			}
			return tasks, err
		}
		k := task{name: t.str("name"), spec: t.str("gpu_spec"), line: t.line}
		var gpus, milli int64
		if k.cpu, err = t.num("cpu_milli", 0, 1<<40); err != nil {
			return nil, err
		}
		if k.mem, err = t.num("memory_mib", 0, 1<<40); err != nil {
			return nil, err
		}
		if gpus, err = t.num("num_gpu", 0, 1024); err != nil {
			return nil, err
		}
		if milli, err = t.num("gpu_milli", 0, 1000); err != nil {
			return nil, err
		}
		k.gpus, k.milli = int(gpus), int(milli)
		switch {
		case k.gpus == 0:
			k.milli = 0
		case k.gpus > 1 && k.milli != 1000:
			return nil, fmt.Errorf("%s:%d: column gpu_milli: %d with num_gpu %d: a multi-GPU task takes whole GPUs (1000)",
				file, t.line, k.milli, k.gpus)
		case k.milli == 0 || k.milli%10 != 0:
			return nil, fmt.Errorf("%s:%d: column gpu_milli: %d: must be a multiple of 10 between 10 and 1000 (a share in whole compute percent)",
				file, t.line, k.milli)
		}
		tasks = append(tasks, k)
	}
}
