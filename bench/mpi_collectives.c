/*
 * mpi_collectives.c: MPI's own reduce-scatter and all-gather in a loop, the
 * yardstick of zero's MPI communicator (BenchmarkMPICollectives, which
 * measures the same way). For each size of the full buffer (1 MiB to 256 MiB
 * of fp32): MPI_Reduce_scatter_block (MPI_FLOAT, MPI_SUM), MPI_Allgather
 * (MPI_BYTE) and, as the transport zero's reduce-scatter uses, the same
 * chunks exchanged point to point (MPI_Isend/MPI_Irecv of MPI_BYTE, no sum),
 * and that exchange followed by a one-pass sum in rank order, in blocks that
 * stay in L1: zero's reduce-scatter written in C, its ceiling without the
 * Go side's cost per call.
 * After one call to warm up and a barrier, the mean time of a call over the
 * iterations, on the slowest rank; throughput is the full buffer's bytes
 * over that time.
 *
 *   .mpi/bin/mpicc -O3 -march=native -o /tmp/mpi_collectives bench/mpi_collectives.c
 *   .mpi/bin/mpiexec -n 2 /tmp/mpi_collectives [iterations [smallest MiB [largest MiB]]]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* out = the sum over ranks, in rank order, of each rank's part r: this
 * rank's own in send, the others' as the exchange left them in recv. */
static void sum_parts(const float* send, const float* recv, float* out, size_t n, int rank, int world) {
	enum { block = 1024 };
	float t[block];
	for (size_t i = 0; i < n; i += block) {
		size_t m = n - i < block ? n - i : block;
		for (int p = 0; p < world; p++) {
			const float* s = (p == rank ? send : recv) + (size_t)p * n + i;
			if (p == 0)
				for (size_t j = 0; j < m; j++) t[j] = s[j];
			else
				for (size_t j = 0; j < m; j++) t[j] += s[j];
		}
		memcpy(out + i, t, m * sizeof(float));
	}
}

static float* out; /* the reduce-scatter's result: one part */

static void call(int op, float* send, float* recv, size_t chunk, int rank, int world) {
	if (op == 0) {
		MPI_Reduce_scatter_block(send, recv, (int)(chunk / 4), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
	} else if (op == 1) {
		MPI_Allgather(send, (int)chunk, MPI_BYTE, recv, (int)chunk, MPI_BYTE, MPI_COMM_WORLD);
	} else {
		MPI_Request req[2 * 64];
		int n = 0;
		for (int p = 0; p < world && p < 64; p++) {
			if (p == rank) continue;
			MPI_Irecv((char*)recv + (size_t)p * chunk, (int)chunk, MPI_BYTE, p, 0, MPI_COMM_WORLD, &req[n++]);
			MPI_Isend((char*)send + (size_t)p * chunk, (int)chunk, MPI_BYTE, p, 0, MPI_COMM_WORLD, &req[n++]);
		}
		MPI_Waitall(n, req, MPI_STATUSES_IGNORE);
		if (op == 3) sum_parts(send, recv, out, chunk / 4, rank, world);
	}
}

int main(int argc, char** argv) {
	int provided, rank, world;
	MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &world);
	int iters = argc > 1 ? atoi(argv[1]) : 10;
	size_t lo = argc > 2 ? (size_t)atoi(argv[2]) : 1, hi = argc > 3 ? (size_t)atoi(argv[3]) : 256;
	if (rank == 0) printf("%-22s %4s %10s %10s\n", "op", "W", "MiB", "GB/s");
	for (size_t mib = 1; mib <= hi; mib *= 4) {
		if (mib < lo) continue;
		size_t bytes = mib << 20, chunk = bytes / (size_t)world;
		float* send = malloc(bytes);
		float* recv = malloc(bytes);
		out = malloc(chunk);
		memset(send, 0, bytes);
		memset(recv, 0, bytes);
		memset(out, 0, chunk);
		for (int op = 0; op < 4; op++) {
			call(op, send, recv, chunk, rank, world); /* warm-up */
			MPI_Barrier(MPI_COMM_WORLD);
			double t0 = MPI_Wtime();
			for (int i = 0; i < iters; i++) call(op, send, recv, chunk, rank, world);
			double dt = (MPI_Wtime() - t0) / iters, slowest;
			MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
			const char* name[] = {"reduce_scatter_block", "allgather", "exchange (p2p)", "exchange + sum"};
			if (rank == 0) printf("%-22s %4d %10zu %10.2f\n", name[op], world, mib, (double)bytes / slowest / 1e9);
		}
		free(send);
		free(recv);
		free(out);
	}
	MPI_Finalize();
	return 0;
}
