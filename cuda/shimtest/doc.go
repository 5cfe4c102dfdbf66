// Package shimtest runs C programs against gpupool's CUDA shim
// (libcuda.so.1) and a CUDA server: the tests build the shim and the
// programs with gcc, serve a lease's calls on a unix socket, and check what
// the programs see. The programs and the PTX they load are in testdata/.
package shimtest
