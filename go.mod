module zero

go 1.26.0

require (
	github.com/NVIDIA/go-nvml v0.13.4-1
	golang.org/x/sys v0.50.0
)

require github.com/google/uuid v1.6.0 // indirect
