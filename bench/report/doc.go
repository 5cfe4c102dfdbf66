// Package report is the scaffold every benchmark of gpupool-bench shares:
// progress lines while it runs, the gpupool binary it measures, and its
// results written as NAME.json, NAME.md and PNG charts under --out.
package report
