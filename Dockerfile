# syntax=docker/dockerfile:1
# Build: docker build -t gpupool .
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# cgo is on: the NVML backend dlopens libnvidia-ml at run time.
RUN CGO_ENABLED=1 go build -trimpath -ldflags="-s -w" -o /out/gpupool ./cmd/gpupool
# The CUDA shim, libcuda.so.1: the node plugin gives it to pods (--cuda-shim).
RUN go run ./cuda/shim/mkshim /out/lib

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 gpupool
COPY --from=build /out/gpupool /usr/local/bin/gpupool
COPY --from=build /out/lib/libcuda.so.1 /usr/local/lib/gpupool/libcuda.so.1
USER gpupool
ENTRYPOINT ["/usr/local/bin/gpupool"]
CMD ["--help"]
