// Package zero partitions the gradients and optimizer state of
// data-parallel training the way DeepSpeed's ZeRO does, for Go training
// stacks: each of W ranks keeps only its shard of the reduced gradient and
// of the optimizer state, and gradients are reduce-scattered in buckets
// while backward is still running.
//
// What it does today:
//
//   - New checks the Config (grouped by policy: Precision, Grads, Optimizer,
//     Window, Params, Offload) and the parameters before anything else, cuts
//     the parameters into buckets (in backward order, each padded to split
//     evenly into W shards), and compares every shared setting across ranks
//     by name.
//
//   - The framework hands over each gradient as backward produces it, on the
//     stream that wrote it (GradReady, or GradsReady for several at once).
//     The engine flattens it into its bucket, waits for every stream that
//     wrote into the bucket, reduce-scatters the bucket and accumulates this
//     rank's part into an fp32 shard: every backward at stages 2 and 3, once
//     per step at stage 1 (which sums locally in fp32 until then).
//
//   - Step closes the window of backwards since the last Step. After it, the
//     shard holds the mean over ranks and backwards (or the sum, with
//     Grads.Reduction Sum); GradShard, FullGrads and per-parameter views
//     (GradView) read it.
//
//   - With Config.Optimizer.Groups, Step also runs the optimizer on this
//     rank's fp32 master shard: the global norm and clipping, the fp16 loss scaler, a
//     skip on inf or NaN agreed by every rank, one fused AdamW or SGD pass
//     for every parameter group, and (stages 1 and 2) an all-gather of the
//     new parameters into the memory registered with them (Param.Data).
//
//   - Without a GPU, the kernels are host C and N ranks run in one process
//     (NewLocalGroup). With -tags cuda they are CUDA C, and ranks talk over
//     NCCL (NewNCCL) or share one GPU (NewCUDALocalGroup).
//
//   - At stage 3 each rank keeps only its shard of the parameters (from
//     Param.Data, or built sharded with Param.Init); Gather all-gathers the
//     buckets the framework asks for, with prefetch in the last window's
//     order, and Release hands them back.
//
//   - BeginCoalesce/EndCoalesce (and NoSync, at every stage) let several
//     backwards share one reduction per bucket, within an optional budget
//     of local memory.
//
//   - With Config.Offload.Optimizer, the fp32 gradient shard, the master
//     weights and the optimizer state live in page-locked host memory: each reduced
//     shard is copied to the host as its reduction finishes and summed
//     there, and the optimizer runs on the host.
//
//   - ReadDeepSpeed reads a DeepSpeed JSON config into a Config: each key
//     mapped, checked, accepted with a notice or refused by path.
//     Optimizer.Schedule takes DeepSpeed's learning-rate schedules
//     (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) and PyTorch's
//     linear and cosine with warmup, stepped by the optimizer steps applied.
//
//   - Estimate says, before anything is allocated, what one rank of such an
//     engine holds at its peak (device and page-locked host bytes by kind)
//     and what one step moves, from the engine's own plan; TransformerShape and
//     CountParams make the parameter lists of a 7B or 70B model.
//
//   - Save and Load checkpoint the training state (master, moments, step
//     counts, loss scaler, the caller's bytes) atomically, one file per
//     rank; a checkpoint loads into another world size, stage, bucket size
//     or offload. ExportSafetensors (or CheckpointToSafetensors, offline)
//     writes the fp32 model as one safetensors file without gathering it;
//     ImportSafetensors starts a model from one, sharded at stage 3.
//
// Each rank's Engine is driven from one goroutine. Errors are typed
// (errors.Is with ErrProtocol, ErrCollectiveMismatch, …) and say what to change.
package zero

// Version is this copy's release, the newest released section of
// CHANGELOG.md; a copy built from an untagged commit says the release it
// follows (the Unreleased section lists what it adds).
const Version = "0.1.0"
