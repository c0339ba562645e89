/*
 * mpi_loader_abi.h: the MPI calls of mpi_loader.c for one ABI. mpi_loader.c
 * includes it once per ABI, with ZM_NS naming the functions, ZM_H the type of
 * every handle (int in MPICH's ABI, a pointer in the standard one) and the
 * ZM_K_* macros the ABI's constants. Statuses are kept in a buffer larger than
 * either ABI's MPI_Status (20 and 32 bytes); ZM_K_SOURCE and ZM_K_TAG index
 * their fields as ints.
 */

struct ZM_NS(lib) {
	int (*initialized)(int*);
	int (*finalized)(int*);
	int (*init_thread)(int*, char***, int, int*);
	int (*query_thread)(int*);
	int (*finalize)(void);
	int (*comm_dup)(ZM_H, ZM_H*);
	int (*comm_split)(ZM_H, int, int, ZM_H*);
	int (*comm_split_type)(ZM_H, int, int, ZM_H, ZM_H*);
	int (*comm_free)(ZM_H*);
	int (*comm_rank)(ZM_H, int*);
	int (*comm_size)(ZM_H, int*);
	int (*comm_set_errhandler)(ZM_H, ZM_H);
	int (*comm_get_attr)(ZM_H, int, void*, int*);
	int (*isend)(const void*, int, ZM_H, int, int, ZM_H, ZM_H*);
	int (*irecv)(void*, int, ZM_H, int, int, ZM_H, ZM_H*);
	int (*test)(ZM_H*, int*, void*);
	int (*cancel)(ZM_H*);
	int (*iprobe)(int, int, ZM_H, int*, void*);
	int (*get_count)(const void*, ZM_H, int*);
	int (*error_string)(int, char*, int*);
	int (*error_class)(int, int*);
	int (*get_library_version)(char*, int*);
	int (*reduce_scatter_block)(const void*, void*, int, ZM_H, ZM_H, ZM_H);
	int (*allgather)(const void*, int, ZM_H, void*, int, ZM_H, ZM_H);
};

static struct ZM_NS(lib) ZM_NS(fn);

static int ZM_NS(resolve)(struct ZM_NS(lib) * l, void* lib, const char* path, char* msg, int msglen) {
#define ZM_SYM(field, name)                                                                                      \
	if (!(*(void**)(&l->field) = dlsym(lib, name))) {                                                        \
		snprintf(msg, (size_t)msglen, "%s: symbol %s not found", path, name);                            \
		return -1;                                                                                       \
	}
	ZM_SYM(initialized, "MPI_Initialized")
	ZM_SYM(finalized, "MPI_Finalized")
	ZM_SYM(init_thread, "MPI_Init_thread")
	ZM_SYM(query_thread, "MPI_Query_thread")
	ZM_SYM(finalize, "MPI_Finalize")
	ZM_SYM(comm_dup, "MPI_Comm_dup")
	ZM_SYM(comm_split, "MPI_Comm_split")
	ZM_SYM(comm_split_type, "MPI_Comm_split_type")
	ZM_SYM(comm_free, "MPI_Comm_free")
	ZM_SYM(comm_rank, "MPI_Comm_rank")
	ZM_SYM(comm_size, "MPI_Comm_size")
	ZM_SYM(comm_set_errhandler, "MPI_Comm_set_errhandler")
	ZM_SYM(comm_get_attr, "MPI_Comm_get_attr")
	ZM_SYM(isend, "MPI_Isend")
	ZM_SYM(irecv, "MPI_Irecv")
	ZM_SYM(test, "MPI_Test")
	ZM_SYM(cancel, "MPI_Cancel")
	ZM_SYM(iprobe, "MPI_Iprobe")
	ZM_SYM(get_count, "MPI_Get_count")
	ZM_SYM(error_string, "MPI_Error_string")
	ZM_SYM(error_class, "MPI_Error_class")
	ZM_SYM(get_library_version, "MPI_Get_library_version")
	ZM_SYM(reduce_scatter_block, "MPI_Reduce_scatter_block")
	ZM_SYM(allgather, "MPI_Allgather")
#undef ZM_SYM
	return 0;
}

/* The thread levels, 0..3 whatever the ABI spells them. */
static int ZM_NS(level)(int provided) {
	if (provided >= ZM_K_THREAD_MULTIPLE) return 3;
	if (provided >= ZM_K_THREAD_SERIALIZED) return 2;
	if (provided >= ZM_K_THREAD_FUNNELED) return 1;
	return 0;
}

static int ZM_NS(init)(int want, int* level, int* was_init) {
	int flag = 0, provided = 0, err = ZM_NS(fn).initialized(&flag);
	if (err) return err;
	if (flag) {
		*was_init = 1;
		err = ZM_NS(fn).query_thread(&provided);
	} else {
		err = ZM_NS(fn).init_thread(NULL, NULL, want >= 2 ? ZM_K_THREAD_SERIALIZED : ZM_K_THREAD_FUNNELED, &provided);
		/* errors on the world communicator (a failed dup) come back too */
		if (!err) err = ZM_NS(fn).comm_set_errhandler(ZM_K_COMM_WORLD, ZM_K_ERRORS_RETURN);
	}
	*level = ZM_NS(level)(provided);
	return err;
}

static int ZM_NS(comm_create)(int split, int color, uintptr_t* comm, int* rank, int* size, int* tag_ub, int* local) {
	ZM_H c = ZM_K_COMM_NULL;
	int wrank = 0, err = ZM_NS(fn).comm_rank(ZM_K_COMM_WORLD, &wrank);
	if (!err) err = split ? ZM_NS(fn).comm_split(ZM_K_COMM_WORLD, color, wrank, &c) : ZM_NS(fn).comm_dup(ZM_K_COMM_WORLD, &c);
	if (err) return err;
	if (!err) err = ZM_NS(fn).comm_set_errhandler(c, ZM_K_ERRORS_RETURN);
	if (!err) err = ZM_NS(fn).comm_rank(c, rank);
	if (!err) err = ZM_NS(fn).comm_size(c, size);
	int* ub = NULL;
	int found = 0;
	if (!err) err = ZM_NS(fn).comm_get_attr(c, ZM_K_TAG_UB, &ub, &found);
	*tag_ub = (!err && found && ub) ? *ub : 32767; /* the least MPI allows */
	/* the processes of the world on this host (0: unknown) */
	ZM_H host = ZM_K_COMM_NULL;
	*local = 0;
	if (!err) err = ZM_NS(fn).comm_split_type(ZM_K_COMM_WORLD, ZM_K_COMM_TYPE_SHARED, wrank, ZM_K_INFO_NULL, &host);
	if (!err) {
		err = ZM_NS(fn).comm_size(host, local);
		ZM_NS(fn).comm_free(&host);
	}
	if (err) {
		ZM_NS(fn).comm_free(&c);
		return err;
	}
	*comm = (uintptr_t)c;
	return 0;
}

static int ZM_NS(comm_free)(uintptr_t comm) {
	ZM_H c = (ZM_H)comm;
	return ZM_NS(fn).comm_free(&c);
}

static int ZM_NS(post)(uintptr_t comm, zm_xfer* x, int n) {
	for (int i = 0; i < n; i++) {
		if (x[i].state != 0) continue;
		ZM_H req = ZM_K_REQUEST_NULL;
		int peer = x[i].peer == ZM_ANY ? ZM_K_ANY_SOURCE : x[i].peer;
		int err = x[i].recv ? ZM_NS(fn).irecv((void*)x[i].buf, (int)x[i].bytes, ZM_K_BYTE, peer, x[i].tag, (ZM_H)comm, &req)
		                    : ZM_NS(fn).isend((const void*)x[i].buf, (int)x[i].bytes, ZM_K_BYTE, peer, x[i].tag, (ZM_H)comm, &req);
		if (err) {
			x[i].err = err;
			x[i].state = 2;
			return err;
		}
		x[i].req = (uintptr_t)req;
		x[i].state = 1;
	}
	return 0;
}

static int ZM_NS(test)(zm_xfer* x, int n) {
	int pending = 0;
	for (int i = 0; i < n; i++) {
		if (x[i].state != 1) continue;
		int status[ZM_STATUS_INTS] = {0}, flag = 0;
		ZM_H req = (ZM_H)x[i].req;
		int err = ZM_NS(fn).test(&req, &flag, status);
		x[i].req = (uintptr_t)req;
		if (err) {
			x[i].err = err;
			x[i].state = 2;
			return -(i + 1);
		}
		if (!flag) {
			pending++;
			continue;
		}
		x[i].state = 2;
		if (x[i].recv) {
			int count = -1;
			if (ZM_NS(fn).get_count(status, ZM_K_BYTE, &count) || count == ZM_K_UNDEFINED) count = -1;
			x[i].got = count;
			if (x[i].peer == ZM_ANY) x[i].peer = status[ZM_K_SOURCE];
		}
	}
	return pending;
}

static int ZM_NS(cancel)(zm_xfer* x, int budget_ms) {
	if (x->state != 1) return 0;
	ZM_H req = (ZM_H)x->req;
	int err = ZM_NS(fn).cancel(&req);
	x->req = (uintptr_t)req;
	if (err) return err;
	int64_t deadline = zm_now_ms() + budget_ms;
	while (x->state == 1 && zm_now_ms() < deadline) {
		if (ZM_NS(test)(x, 1) < 0) return x->err;
		if (x->state == 1) sched_yield();
	}
	return 0;
}

static int ZM_NS(iprobe)(uintptr_t comm, int peer, int* flag, int* tag, int64_t* bytes) {
	int status[ZM_STATUS_INTS] = {0}, count = -1;
	*flag = 0;
	int err = ZM_NS(fn).iprobe(peer == ZM_ANY ? ZM_K_ANY_SOURCE : peer, ZM_K_ANY_TAG, (ZM_H)comm, flag, status);
	if (err || !*flag) return err;
	*tag = status[ZM_K_TAG];
	if (ZM_NS(fn).get_count(status, ZM_K_BYTE, &count) || count == ZM_K_UNDEFINED) count = -1;
	*bytes = count;
	return 0;
}

static int ZM_NS(error_string)(int code, char* buf, int len, int* truncate) {
	char s[ZM_MAX_ERROR_STRING + 1] = {0};
	int n = 0, cls = -1;
	if (ZM_NS(fn).error_string(code, s, &n)) snprintf(s, sizeof s, "MPI error %d", code);
	snprintf(buf, (size_t)len, "%s", s);
	if (ZM_NS(fn).error_class(code, &cls)) cls = -1;
	*truncate = cls == ZM_K_ERR_TRUNCATE;
	return cls;
}

/* calls × MPI's own reduce-scatter (fp32, MPI_SUM) or all-gather (bytes),
 * blocking, in a C loop: the yardstick of BenchmarkMPICollectives. zero's
 * collectives never call it. */
static int ZM_NS(own)(uintptr_t comm, int gather, uintptr_t send, uintptr_t recv, int64_t part_bytes, int calls) {
	int err = 0;
	for (int i = 0; i < calls && !err; i++) {
		err = gather ? ZM_NS(fn).allgather((const void*)send, (int)part_bytes, ZM_K_BYTE, (void*)recv, (int)part_bytes,
		                                   ZM_K_BYTE, (ZM_H)comm)
		             : ZM_NS(fn).reduce_scatter_block((const void*)send, (void*)recv, (int)(part_bytes / 4), ZM_K_FLOAT,
		                                              ZM_K_SUM, (ZM_H)comm);
	}
	return err;
}
