/*
 * mpi_api.h: what mpi.go calls of mpi_loader.c, the MPI library loaded at
 * run time with dlopen. No mpi.h is needed to build: the two ABIs zero speaks
 * (MPICH's, libmpi.so.12, and the MPI 5.0 standard ABI, libmpi_abi.so) are
 * declared in mpi_loader_abi.h from their documented handles and constants.
 */
#ifndef ZERO_MPI_API_H
#define ZERO_MPI_API_H

#include <stdint.h>

#define ZM_ABI_MPICH 1    /* libmpi.so.12: MPICH, Intel MPI, MVAPICH, Cray MPICH */
#define ZM_ABI_STANDARD 2 /* libmpi_abi.so: the MPI 5.0 standard ABI */

#define ZM_ERR_NOT_LOADED (-1000) /* no library loaded: not an MPI code */
#define ZM_ANY (-1)               /* MPI_ANY_SOURCE or MPI_ANY_TAG in the ABI's spelling */

/* One point-to-point transfer of at most 2^31−1 bytes (the caller splits
 * larger ones). state: 0 not posted, 1 posted, 2 complete. */
typedef struct {
	uintptr_t buf;
	int64_t bytes;
	int64_t got; /* a receive's byte count, −1 where MPI could not say */
	uintptr_t req;
	int32_t peer; /* after a receive from ZM_ANY: the sender */
	int32_t tag;
	int32_t recv;
	int32_t state;
	int32_t err; /* the MPI code of the post or the completion, 0 if none */
	int32_t pad;
} zm_xfer;

/* Loads the process's MPI once; later calls return its ABI. */
int zm_load(const char* path, int* abi, char* msg, int msglen);
/* Opens path, resolves its symbols and reads MPI_Get_library_version,
 * without keeping it or initialising MPI. */
int zm_probe(const char* path, int* abi, char* version, int vlen, char* msg, int msglen);
/* MPI_Init_thread(want: 1 FUNNELED, 2 SERIALIZED) unless MPI is initialized
 * already (*was_init); *level is the thread level provided, 0 (single) to 3
 * (multiple); the bits of *restored are the signals whose handlers init
 * changed and that were put back. */
int zm_init(int want, int* level, int* was_init, uint64_t* restored);
int zm_finalize(void);
/* A communicator of its own: MPI_COMM_WORLD duplicated, or split by color
 * when split is set, with errors returned to the caller; *local is the
 * number of the world's processes on this host (MPI_COMM_TYPE_SHARED). */
int zm_comm_create(int split, int color, uintptr_t* comm, int* rank, int* size, int* tag_ub, int* local);
int zm_comm_free(uintptr_t comm);
int zm_post(uintptr_t comm, zm_xfer* x, int n);
/* Tests every posted transfer; returns how many are still pending, or
 * −(i+1) for transfer i that failed (its err set). */
int zm_test(zm_xfer* x, int n);
/* Cancels a posted receive and waits up to budget_ms for the cancel. */
int zm_cancel(zm_xfer* x, int budget_ms);
/* calls × MPI's own MPI_Reduce_scatter_block (fp32, MPI_SUM; gather 0) or
 * MPI_Allgather (bytes; gather 1) in a C loop: a benchmark's yardstick. */
int zm_own(uintptr_t comm, int gather, uintptr_t send, uintptr_t recv, int64_t part_bytes, int calls);
int zm_iprobe(uintptr_t comm, int peer, int* flag, int* tag, int64_t* bytes);
/* MPI's text for code (buf) and its class; *truncate says whether the class
 * is MPI_ERR_TRUNCATE. */
int zm_error_string(int code, char* buf, int len, int* truncate);

#endif
