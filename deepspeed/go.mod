module zero/deepspeed

go 1.26.0

require (
	github.com/nlpodyssey/gopickle v0.2.0
	zero v0.0.0
)

require (
	github.com/NVIDIA/go-nvml v0.13.4-1 // indirect
	golang.org/x/sys v0.50.0 // indirect
)

replace zero => ../
