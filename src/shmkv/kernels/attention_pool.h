/*
 * kernels/attention_pool.h -- the attention kernel's threads: its own pthread pool, or the team of an
 * OpenMP runtime already in the process (torch's libgomp); fork handling; the thread count.
 * A part of attention.c (included once by it, as attention_isa.h is), not a header of its
 * own: it uses what attention.c defines above the include.
 */
/* ---- the thread pool ------------------------------------------------------------------ */

typedef struct {                /* one thread's scratch, grown, never shrunk */
    float *buf;
    size_t cap;                 /* floats */
} shmkv_scratch_t;

static struct {
    pthread_mutex_t call_mu;    /* one call at a time; held across fork() by prepare */
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    int wanted;                 /* threads per call, the caller included; 0 = not decided */
    int nworkers;               /* helper threads running (wanted - 1 once started) */
    pthread_t *tids;
    uint64_t gen;               /* job generation */
    uint64_t born_gen;          /* gen when the helpers were created: their first "seen" */
    int started;                /* helpers created for this configuration */
    int stop;
    int pending;                /* helpers still on the current job */
    shmkv_task_fn fn;
    void *ctx;
    uint32_t nitems;
    uint32_t next;              /* next item to take (atomic) */
    shmkv_scratch_t *scratch;   /* [wanted] */
    /* a libgomp already in the process (torch's): the items run on its threads */
    void (*omp_parallel)(void (*)(void *), void *, unsigned, unsigned);
    int (*omp_thread_num)(void);
    unsigned long long omp_adds, omp_subs;  /* dl_iterate_phdr's load counters at the scan */
    int omp_off;                /* SHMKV_ATTN_POOL=own, or a fork() child: never */
} P = { .call_mu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
        .work_cv = PTHREAD_COND_INITIALIZER, .done_cv = PTHREAD_COND_INITIALIZER };


static pthread_once_t shmkv_att_once = PTHREAD_ONCE_INIT;

static void shmkv_pool_run_items(int tid) {
    for (;;) {
        uint32_t i = __atomic_fetch_add(&P.next, 1, __ATOMIC_RELAXED);
        if (i >= P.nitems) break;
        P.fn(P.ctx, i, tid);
    }
}

static void *shmkv_pool_worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    /* born_gen, not gen: a job posted between pthread_create and this lock is ours too */
    pthread_mutex_lock(&P.mu);
    uint64_t seen = P.born_gen;
    for (;;) {
        while (P.gen == seen && !P.stop) pthread_cond_wait(&P.work_cv, &P.mu);
        if (P.stop) break;
        seen = P.gen;
        pthread_mutex_unlock(&P.mu);
        shmkv_pool_run_items(tid);
        pthread_mutex_lock(&P.mu);
        if (--P.pending == 0) pthread_cond_signal(&P.done_cv);
    }
    pthread_mutex_unlock(&P.mu);
    return NULL;
}

static int shmkv_affinity_count(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    return 1;
}

/* Stops and joins the helpers (call_mu held). */
static void shmkv_pool_stop(void) {
    pthread_mutex_lock(&P.mu);
    P.stop = 1;
    pthread_cond_broadcast(&P.work_cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.nworkers; i++) pthread_join(P.tids[i], NULL);
    free(P.tids);
    P.tids = NULL;
    P.nworkers = 0;
    P.started = 0;
    P.stop = 0;
}

/* Makes the scratch table if needed (call_mu held).  0, or -1 on ENOMEM.  The helper
 * threads are started by the first call that runs on the library's own pool. */
static int shmkv_pool_start(void) {
    if (P.wanted == 0) P.wanted = shmkv_affinity_count();
    if (P.scratch == NULL) {
        P.scratch = calloc((size_t)P.wanted, sizeof(shmkv_scratch_t));
        if (P.scratch == NULL) return -1;
    }
    return 0;
}

/* Starts the helpers once per configuration (call_mu held); fewer if some fail. */
static void shmkv_pool_helpers(void) {
    if (P.started) return;
    P.tids = calloc((size_t)P.wanted, sizeof(pthread_t));
    if (P.tids == NULL) return;                 /* no helpers: the caller does it all */
    P.started = 1;
    pthread_mutex_lock(&P.mu);
    P.born_gen = P.gen;
    for (int i = 1; i < P.wanted; i++) {
        if (pthread_create(&P.tids[P.nworkers], NULL, shmkv_pool_worker, (void *)(intptr_t)i))
            break;                              /* fewer helpers: still correct */
        P.nworkers++;
    }
    pthread_mutex_unlock(&P.mu);
}

/* ---- sharing an OpenMP runtime already loaded (torch's libgomp) ------------------------
 * Inside a model, torch's OpenMP threads spin for a while after each parallel region (a
 * linear layer); a second pool of our own then fights them for the cores, and the kernel
 * took 3.5x its time alone.  When the process has a libgomp loaded (torch brings one), the
 * items run on *its* team through GOMP_parallel, the entry point GCC emits for `#pragma omp
 * parallel`: the spinning threads are the ones that pick the work up, at no wake-up cost,
 * and there is one set of threads on the cores.  shmkv does not link libgomp: the library
 * is looked up among those already loaded (dl_iterate_phdr, then dlopen RTLD_NOLOAD, which
 * also pins it), re-scanned only when the loader's counters say something was loaded or
 * unloaded.  Off in a fork() child (a libgomp team does not survive fork; the own pool
 * does) and with SHMKV_ATTN_POOL=own. */
typedef struct {
    char path[4096];
    int rank;                   /* 2: torch's, 1: another libgomp, 0: none found */
} shmkv_omp_scan_t;

static int shmkv_omp_cb(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    shmkv_omp_scan_t *s = data;
    const char *name = info->dlpi_name;
    if (name == NULL || *name == 0) return 0;
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    if (strncmp(base, "libgomp", 7) != 0) return 0;
    const int rank = strstr(name, "torch") ? 2 : 1;
    if (rank > s->rank && strlen(name) < sizeof s->path) {
        strcpy(s->path, name);
        s->rank = rank;
    }
    return 0;
}

static int shmkv_omp_counters_cb(struct dl_phdr_info *info, size_t size, void *data) {
    unsigned long long *c = data;
    if (size >= offsetof(struct dl_phdr_info, dlpi_subs) + sizeof info->dlpi_subs) {
        c[0] = info->dlpi_adds;
        c[1] = info->dlpi_subs;
    }
    return 1;                                   /* the first object carries the counters */
}

/* Finds the loaded libgomp's entry points, when the set of loaded objects changed
 * (call_mu held).  Once found they are kept: the RTLD_NOLOAD handle pins the library. */
static void shmkv_omp_refresh(void) {
    if (P.omp_off || P.omp_parallel) return;
    unsigned long long c[2] = { 0, 0 };
    dl_iterate_phdr(shmkv_omp_counters_cb, c);
    if (c[0] == P.omp_adds && c[1] == P.omp_subs && c[0] != 0) return;
    P.omp_adds = c[0];
    P.omp_subs = c[1];
    shmkv_omp_scan_t s = { .rank = 0 };
    dl_iterate_phdr(shmkv_omp_cb, &s);
    if (!s.rank) return;
    void *h = dlopen(s.path, RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL) return;
    void *par = dlsym(h, "GOMP_parallel"), *num = dlsym(h, "omp_get_thread_num");
    if (par == NULL || num == NULL) { dlclose(h); return; }
    *(void **)&P.omp_parallel = par;
    *(void **)&P.omp_thread_num = num;
}

static void shmkv_omp_body(void *arg) {
    (void)arg;
    const int tid = P.omp_thread_num();
    /* a team larger than asked cannot happen (GOMP gives at most num_threads); a thread
     * number out of range would index past the scratch table, so it does no work */
    if (tid >= 0 && tid < P.wanted) shmkv_pool_run_items(tid);
}

/* Which pool runs the kernel's items now: "openmp" (a loaded libgomp's) or "own". */
static void shmkv_att_init(void);
const char *shmkv_attn_pool(void) {
    pthread_once(&shmkv_att_once, shmkv_att_init);
    pthread_mutex_lock(&P.call_mu);
    shmkv_omp_refresh();
    const char *r = P.omp_parallel && !P.omp_off ? "openmp" : "own";
    pthread_mutex_unlock(&P.call_mu);
    return r;
}

/* Runs fn over items 0..n-1 on the caller and the helpers, or on the loaded OpenMP
 * runtime's team (call_mu held). */
static void shmkv_pool_run(shmkv_task_fn fn, void *ctx, uint32_t n, int threads) {
    P.fn = fn;
    P.ctx = ctx;
    P.nitems = n;
    __atomic_store_n(&P.next, 0, __ATOMIC_RELAXED);
    if (threads > P.wanted) threads = P.wanted;
    if (threads <= 1 || n <= 1) {
        shmkv_pool_run_items(0);
        return;
    }
    shmkv_omp_refresh();
    if (P.omp_parallel && !P.omp_off) {
        P.omp_parallel(shmkv_omp_body, NULL, (unsigned)threads, 0);
        return;
    }
    shmkv_pool_helpers();
    if (P.nworkers == 0) {
        shmkv_pool_run_items(0);
        return;
    }
    pthread_mutex_lock(&P.mu);
    P.pending = P.nworkers;
    P.gen++;
    pthread_cond_broadcast(&P.work_cv);
    pthread_mutex_unlock(&P.mu);
    shmkv_pool_run_items(0);
    pthread_mutex_lock(&P.mu);
    while (P.pending > 0) pthread_cond_wait(&P.done_cv, &P.mu);
    pthread_mutex_unlock(&P.mu);
}

/* fork(): the prepare handler waits for a call in flight, so the child inherits a quiet
 * pool; the child forgets the parent's threads (they do not exist there) and starts its
 * own on its first call. */
static void shmkv_att_prepare(void) { pthread_mutex_lock(&P.call_mu); }
static void shmkv_att_parent(void) { pthread_mutex_unlock(&P.call_mu); }
static void shmkv_att_child(void) {
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.work_cv, NULL);
    pthread_cond_init(&P.done_cv, NULL);
    P.tids = NULL;              /* the parent's: leaked on purpose, never joined here */
    P.nworkers = 0;
    P.started = 0;
    P.stop = 0;
    P.pending = 0;
    P.omp_off = 1;              /* the parent's OpenMP team is not in this process */
    pthread_mutex_init(&P.call_mu, NULL);
}
static void shmkv_att_init(void) {
    pthread_atfork(shmkv_att_prepare, shmkv_att_parent, shmkv_att_child);
    const char *pool = getenv("SHMKV_ATTN_POOL");
    if (pool && !strcmp(pool, "own")) P.omp_off = 1;
}

int shmkv_attn_set_threads(int n) {
    pthread_once(&shmkv_att_once, shmkv_att_init);
    if (n < 0) return -1;
    pthread_mutex_lock(&P.call_mu);
    shmkv_pool_stop();
    for (int i = 0; P.scratch && i < P.wanted; i++) free(P.scratch[i].buf);
    free(P.scratch);
    P.scratch = NULL;
    P.wanted = n == 0 ? shmkv_affinity_count() : n;
    pthread_mutex_unlock(&P.call_mu);
    return 0;
}

int shmkv_attn_get_threads(void) {
    pthread_once(&shmkv_att_once, shmkv_att_init);
    pthread_mutex_lock(&P.call_mu);
    if (P.wanted == 0) P.wanted = shmkv_affinity_count();
    int n = P.wanted;
    pthread_mutex_unlock(&P.call_mu);
    return n;
}
