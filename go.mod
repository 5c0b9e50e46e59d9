module github.com/ptxmig/ptxmig

go 1.26.0

require (
	github.com/NVIDIA/go-nvml v0.13.3-0
	github.com/checkpoint-restore/go-criu/v7 v7.2.0
	github.com/klauspost/compress v1.20.3
	github.com/prometheus/client_model v0.6.3
	github.com/prometheus/common v0.72.1
	github.com/urfave/cli/v2 v2.27.7
	github.com/zeebo/blake3 v0.2.4
	golang.org/x/sys v0.49.0
	golang.org/x/term v0.47.0
	google.golang.org/protobuf v1.36.12
)

require (
	github.com/cpuguy83/go-md2man/v2 v2.0.7 // indirect
	github.com/klauspost/cpuid/v2 v2.0.12 // indirect
	github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 // indirect
	github.com/russross/blackfriday/v2 v2.1.0 // indirect
	github.com/xrash/smetrics v0.0.0-20240521201337-686a1a2994c1 // indirect
)
