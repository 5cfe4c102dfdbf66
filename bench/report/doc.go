// Package report is what every benchmark shares: progress lines while it
// runs, building the gpupool binary it measures, and writing its results.
package report
