/* test_fuzz.c — issue 31: random configs and arguments, valid and invalid, through
 * mok_context_create, mok_forward and mok_backward on the CPU backend, W ranks a thread
 * each over one mok_cpu_comm.
 *
 * Every call's expected status comes from predicates written here from the rules of
 * mok.h and api.c (validate_config, attach's verdict, the pointer tables, the saved
 * check of docs/CPU.md), not from the library. Most iterations break at most one rule,
 * so the check is exact; a few break several, and then the status of any broken rule is
 * accepted (api.c's order is not the contract). With W > 1 the ranks' verdicts combine
 * as the library's barriers make them: a rank that fails on its own arguments leaves
 * its peers waiting (MOK_STATUS_COMM_TIMEOUT), the attach and saved checks give every
 * rank one verdict. Each call is checked for
 *   - the status, and a message that names the argument (cfg.K, args->num_tokens, ...);
 *   - every buffer it may not write left as it was, byte for byte (outputs hold a poison
 *     before the call; inputs, 256 bytes past each buffer's end, and saved when the
 *     call does not write it are compared too);
 *   - on success, finite outputs and (D3) the bits of the same global batch on one rank:
 *     a mok_problem_run at W = 1 of the same mok_problem (tools/problem.h). The
 *     replicated sums (losses, router and shared-expert gradients) are compared only
 *     where every rank but the last has a multiple of 64 tokens (README's known limit)
 *     and are otherwise checked finite and equal on every rank.
 *
 * Cases:
 *   create       configs through mok_context_create on W ranks
 *   calls        valid contexts (W = 1..4, per-rank cfg.T, num_tokens, capacity and
 *                threads), forward and backward arguments broken one at a time, then
 *                a valid step checked against W = 1, then a second backward
 *   saved        saved buffers a backward must refuse: 0xFF over bytes 512.. (header
 *                intact), another context's (also one created at the freed address),
 *                another num_tokens, header fields, then random single corruptions of
 *                counts, experts and row positions (refused), and of bytes the
 *                backward does not trust or need (accepted, the same or finite bits)
 *   empty_batch  num_tokens = 0 (W = 1: zero counts, losses and bf16 gradients, saved
 *                neither written nor read; W = 2: the bits of the W = 1 empty batch)
 *   timeouts     W = 2 creates with a late rank and finite comm_timeout_s up to DBL_MAX
 *                (each in a child process with an alarm: a wait that never ends must
 *                not stop the runner)
 *
 * Budget: MOK_FUZZ_SECONDS (default 4) shared by the random cases; MOK_FUZZ_ITERATIONS
 * runs that many iterations of each instead. Seeds come from the runner's: a failing
 * iteration prints its config and the line that replays it alone,
 * MOK_FUZZ_ITER=i mok_tests --seed S -k fuzz.<case>. */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "internal.h" /* MOK_MAX_RANKS, MOK_MAX_EXPERTS; the saved layout (mok_plan_saved) to aim at */
#include "runner.h"

enum {
  kMaxW = 8,         /* ranks of a calls world */
  kMaxCreateW = 64,  /* ranks of a create iteration (MOK_MAX_RANKS) */
  kSlack = 256,      /* bytes past every buffer: compared, and room for misaligned pointers */
  kMaxLines = 40,    /* failure lines printed per case */
  kMinIterations = 4 /* per random case, whatever the budget */
};
#define POISON 0xA5

/* ---- random numbers ---- */

static uint64_t rnd(uint64_t* s) { return test_next(s); }
static int64_t rnd_in(uint64_t* s, int64_t lo, int64_t hi) { /* [lo, hi] */
  return lo + (int64_t)(rnd(s) % (uint64_t)(hi - lo + 1));
}
static int pct(uint64_t* s, int p) { return (int)(rnd(s) % 100) < p; }
static int64_t pick(uint64_t* s, const int64_t* v, int n) { return v[rnd(s) % (uint64_t)n]; }
#define PICK(s, ...) pick((s), (const int64_t[]){__VA_ARGS__}, \
                          (int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))

/* A small dimension, most often below 20: an iteration is milliseconds. */
static int64_t small_dim(uint64_t* s, int64_t max) {
  int64_t v;
  do v = PICK(s, 1, 2, 3, 4, 5, 6, 8, 8, 11, 16, 16, 17, 24, 32, 64);
  while (v > max);
  return v;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char* sname(mok_status_t s) { /* "MOK_STATUS_X" of mok_status_string's "MOK_STATUS_X: ..." */
  static char buf[8][48];
  static int next;
  char* b = buf[next++ % 8];
  snprintf(b, 48, "%s", mok_status_string(s));
  char* colon = strchr(b, ':');
  if (colon) *colon = '\0';
  return b;
}

/* ---- the budget and the log of one case ---- */

typedef struct {
  double t_end;
  int64_t iter, only, count; /* current; MOK_FUZZ_ITER; MOK_FUZZ_ITERATIONS (-1: none) */
  int64_t done;              /* iterations run */
  double t0;
  /* failures */
  int64_t cur;           /* iteration being logged (-1: a deterministic one) */
  char desc[2048];       /* its config, printed before its first failure */
  int cur_failed, failed, lines;
  struct {
    char what[64];
    int count;
  } tally[48];
  int num_tally;
  int64_t seen[MOK_STATUS_COUNT_ + 1]; /* calls checked, by the status they returned */
} fz_log_t;

static double fuzz_seconds(void) {
  const char* v = getenv("MOK_FUZZ_SECONDS");
  double s = v ? atof(v) : 4.0;
  return s > 0 ? s : 0;
}

static void log_begin(fz_log_t* L, double share) {
  memset(L, 0, sizeof *L);
  const char* only = getenv("MOK_FUZZ_ITER");
  const char* count = getenv("MOK_FUZZ_ITERATIONS");
  L->only = only ? atoll(only) : -1;
  L->count = count ? atoll(count) : -1;
  L->t0 = now_s();
  L->t_end = L->t0 + fuzz_seconds() * share;
  L->iter = -1;
  L->cur = -1;
}

/* The next iteration of a random case, 0 when its budget is spent. */
static int log_next(fz_log_t* L) {
  if (L->only >= 0) {
    if (L->iter == L->only) return 0;
    L->iter = L->only;
  } else {
    L->iter++;
    if (L->count >= 0 ? L->iter >= L->count : L->iter >= kMinIterations && now_s() >= L->t_end) return 0;
  }
  L->cur = L->iter;
  L->cur_failed = 0;
  L->desc[0] = '\0';
  L->done++;
  return 1;
}

/* A deterministic sub-case: logged like an iteration, replayed by running the case. */
static void log_step(fz_log_t* L, const char* what) {
  L->cur = -1;
  L->cur_failed = 0;
  snprintf(L->desc, sizeof L->desc, "%s", what);
}

static uint64_t iteration_seed(const fz_log_t* L) {
  uint64_t s = test_case_seed() ^ (0x9e3779b97f4a7c15ull * (uint64_t)(L->iter + 1));
  return test_next(&s);
}

/* Records a failure of the current iteration under `what` (the rule or property, for
 * the tally printed at the end) and prints it, with the iteration, while lines last. */
static void fz_fail(fz_log_t* L, const char* what, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
static void fz_fail(fz_log_t* L, const char* what, const char* fmt, ...) {
  int i = 0;
  while (i < L->num_tally && strcmp(L->tally[i].what, what) != 0) i++;
  if (i == L->num_tally && L->num_tally < 48) snprintf(L->tally[L->num_tally++].what, 64, "%s", what);
  if (i < 48) L->tally[i].count++;
  if (!L->cur_failed) {
    L->cur_failed = 1;
    L->failed++;
    if (L->lines < kMaxLines) {
      if (L->cur >= 0)
        printf("    iteration %lld (replay: MOK_FUZZ_ITER=%lld mok_tests --seed %llu -k %s):\n      %s\n",
               (long long)L->cur, (long long)L->cur, (unsigned long long)test_seed, test_current, L->desc);
      else
        printf("    %s:\n", L->desc);
      L->lines += 2;
    }
  }
  if (L->lines < kMaxLines) {
    va_list ap;
    va_start(ap, fmt);
    printf("      ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    if (++L->lines == kMaxLines) printf("    (no more failure lines: the tally follows)\n");
  }
}

/* Prints the case's totals (iterations: 0 for a case of deterministic steps only). */
static int log_end(fz_log_t* L, int iterations) {
  if (iterations)
    printf("    %lld iterations in %.2f s, %d failed\n", (long long)L->done, now_s() - L->t0, L->failed);
  char line[1024] = "    statuses (rank calls):";
  int any = 0;
  for (int i = 0; i <= MOK_STATUS_COUNT_; i++)
    if (L->seen[i]) {
      const size_t at = strlen(line);
      snprintf(line + at, sizeof line - at, " %s %lld", i < MOK_STATUS_COUNT_ ? sname((mok_status_t)i) + 11 : "other",
               (long long)L->seen[i]);
      any = 1;
    }
  if (any) printf("%s\n", line);
  for (int i = 0; i < L->num_tally; i++) printf("    failed: %s (%d)\n", L->tally[i].what, L->tally[i].count);
  return L->failed ? 1 : 0;
}

/* ---- what a call may return ---- */

/* A broken rule: the statuses it may give and the words its message must hold (one of
 * the '|'-separated; NULL: the message is not checked). */
typedef struct {
  const char* what;
  mok_status_t status[4];
  int num_status;
  const char* names;
} fz_rule_t;

typedef struct {
  int n;          /* broken rules; none: the call must succeed */
  fz_rule_t r[24];
  int may_succeed; /* a rule that may also pass (a huge but representable shape) */
} fz_want_t;

static void want(fz_want_t* w, const char* what, mok_status_t s, const char* names) {
  if (w->n < 24) w->r[w->n++] = (fz_rule_t){what, {s}, 1, names};
}
static void want_any(fz_want_t* w, const char* what, const mok_status_t* s, int ns, const char* names) {
  if (w->n >= 24) return;
  fz_rule_t* r = &w->r[w->n++];
  *r = (fz_rule_t){what, {0}, ns, names};
  memcpy(r->status, s, (size_t)ns * sizeof *s);
}

/* Does msg hold one of the '|'-separated names? A name with "." or "->" (cfg.F,
 * args->x) must end where a word ends, so that cfg.F is not found in cfg.Fs. */
static int names_one_of(const char* msg, const char* names) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", names);
  for (char *save = NULL, *nm = strtok_r(buf, "|", &save); nm; nm = strtok_r(NULL, "|", &save)) {
    const size_t n = strlen(nm);
    const int whole = strchr(nm, '.') || strstr(nm, "->");
    for (const char* q = msg; (q = strstr(q, nm)) != NULL; q++) {
      const char c = q[n];
      if (!whole || !((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'))
        return 1;
    }
  }
  return 0;
}

/* 0 when got is what w allows and the message names the rule's argument. */
static int check_status(fz_log_t* L, const char* call, int rank, const fz_want_t* w, mok_status_t got,
                        const char* msg) {
  L->seen[(unsigned)got < MOK_STATUS_COUNT_ ? (int)got : MOK_STATUS_COUNT_]++;
  if (w->n == 0 || (w->may_succeed && got == MOK_STATUS_SUCCESS)) {
    if (got == MOK_STATUS_SUCCESS) return 0;
    fz_fail(L, w->n ? w->r[0].what : "a valid call failed", "%s, rank %d: %s, want %s: \"%s\"", call, rank,
            sname(got), w->n ? "success or a rule's status" : "success", msg);
    return 1;
  }
  int status_seen = 0;
  for (int i = 0; i < w->n; i++)
    for (int j = 0; j < w->r[i].num_status; j++)
      if (got == w->r[i].status[j]) {
        status_seen = 1;
        if (!w->r[i].names || (msg && names_one_of(msg, w->r[i].names))) return 0;
      }
  char wants[256] = "";
  for (int i = 0; i < w->n; i++) {
    size_t at = strlen(wants);
    snprintf(wants + at, sizeof wants - at, "%s%s (%s)", i ? ", " : "", sname(w->r[i].status[0]), w->r[i].what);
  }
  if (status_seen)
    fz_fail(L, w->r[0].what, "%s, rank %d: %s, but the message does not name %s: \"%s\"", call, rank, sname(got),
            w->r[0].names, msg ? msg : "(null)");
  else
    fz_fail(L, w->r[0].what, "%s, rank %d: %s, want %s: \"%s\"", call, rank, sname(got), wants,
            msg ? msg : "(null)");
  return 1;
}

/* ---- W ranks, a thread each ---- */

typedef void (*fz_op_t)(void* item);
typedef struct {
  fz_op_t op;
  void* item;
} fz_thread_t;

static void* thread_main(void* p) {
  fz_thread_t* t = p;
  t->op(t->item);
  return NULL;
}

/* Runs op on each of n items (size bytes apart) at once, one thread each (n > 1). */
static void on_ranks(int n, fz_op_t op, void* items, size_t size) {
  if (n == 1) {
    op(items);
    return;
  }
  pthread_t th[kMaxCreateW];
  fz_thread_t t[kMaxCreateW];
  for (int r = 0; r < n; r++) {
    t[r] = (fz_thread_t){op, (char*)items + (size_t)r * size};
    if (pthread_create(&th[r], NULL, thread_main, &t[r]) != 0) abort();
  }
  for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
}

/* One rank's create: its config, its context, the status and message (the create
 * message is per thread: copied on the creating thread). */
typedef struct {
  mok_config_t cfg;
  mok_context_t* ctx;
  mok_status_t status;
  char msg[MOK_ERROR_LEN];
} fz_create_t;

static void op_create(void* p) {
  fz_create_t* c = p;
  static int sentinel;
  c->ctx = (mok_context_t*)&sentinel; /* a failing create must set it to NULL */
  c->status = mok_context_create(&c->cfg, &c->ctx);
  snprintf(c->msg, sizeof c->msg, "%s", c->status ? mok_last_create_error() : "");
}

static void op_destroy(void* p) {
  fz_create_t* c = p;
  if (c->ctx) c->status = mok_context_destroy(c->ctx);
  c->ctx = NULL;
}

/* ---- configs ---- */

static int describe_cfg(char* b, size_t n, const mok_config_t* c) {
  return snprintf(b, n,
                  "T=%lld H=%lld F=%lld E=%lld K=%lld W=%d rank=%d Fs=%lld routing=%d score=%d normalize=%d "
                  "route_scale=%.9g bias=%d aux=%.9g z=%.9g n_group=%d topk_group=%d group_score=%d "
                  "router_bias=%d expert_bias=%d activation=%d alpha=%.9g limit=%.9g shared_gate=%d wgrad=%d "
                  "numerics=%d "
                  "backend=%d capacity=%lld "
                  "threads=%d timeout=%.9g ctas=%d pairs=%d gate_up=%d saved_use=%d size=%zu version=%d comm=%s",
                  (long long)c->T, (long long)c->H, (long long)c->F, (long long)c->E, (long long)c->K, c->W, c->rank,
                  (long long)c->Fs, (int)c->routing, (int)c->score, c->normalize, (double)c->route_scale,
                  c->use_bias_select, (double)c->aux_loss_coef, (double)c->z_loss_coef, c->n_group, c->topk_group,
                  (int)c->group_score, c->use_router_bias, c->use_expert_bias, (int)c->activation,
                  (double)c->swiglu_alpha, (double)c->swiglu_limit, c->use_shared_gate, (int)c->wgrad,
                  (int)c->numerics, (int)c->backend, (long long)c->capacity, c->num_threads, c->comm_timeout_s,
                  c->num_ctas, (int)c->cta_pairs, (int)c->gate_up, (int)c->saved_use, c->struct_size, c->version,
                  c->cpu_comm ? "set" : "NULL");
}

/* The rules one rank's create checks alone (validate_config, in api.c's order);
 * comm_ranks: 0 when cfg.cpu_comm is NULL, -1 when it is no communicator, else its
 * ranks. */
static void want_create_local(const mok_config_t* c, int comm_ranks, fz_want_t* w) {
  const mok_status_t SHAPE = MOK_STATUS_INVALID_SHAPE, ARG = MOK_STATUS_INVALID_ARGUMENT,
                     NONFINITE = MOK_STATUS_NONFINITE_VALUE, UNSUPPORTED = MOK_STATUS_UNSUPPORTED_SHAPE;
  if (c->struct_size != sizeof(mok_config_t) || c->version != MOK_VERSION_CODE)
    want(w, "cfg.version", MOK_STATUS_VERSION_MISMATCH, "cfg.struct_size|cfg.version");
  if (c->T < 0) want(w, "cfg.T < 0", SHAPE, "cfg.T");
  if (c->H < 1) want(w, "cfg.H < 1", SHAPE, "cfg.H");
  if (c->F < 1) want(w, "cfg.F < 1", SHAPE, "cfg.F");
  if (c->E < 1) want(w, "cfg.E < 1", SHAPE, "cfg.E");
  if (c->K < 1 || c->K > c->E) want(w, "cfg.K outside [1, E]", SHAPE, "cfg.K");
  const int w_ok = c->W >= 1 && c->W <= MOK_MAX_RANKS;
  if (!w_ok) want(w, "cfg.W outside [1, 64]", SHAPE, "cfg.W");
  if (w_ok && c->E >= 1 && c->E % c->W) want(w, "cfg.E % cfg.W", SHAPE, "cfg.E|cfg.W");
  if (c->Fs < 0) want(w, "cfg.Fs < 0", SHAPE, "cfg.Fs");
  if (c->capacity < 0) want(w, "cfg.capacity < 0", SHAPE, "cfg.capacity");
  if (w_ok && (c->rank < 0 || c->rank >= c->W)) want(w, "cfg.rank outside [0, W)", ARG, "cfg.rank");
  if ((unsigned)c->routing > MOK_ROUTING_REPLAY) want(w, "cfg.routing", ARG, "cfg.routing");
  if ((unsigned)c->score > MOK_SCORE_SIGMOID) want(w, "cfg.score", ARG, "cfg.score");
  if ((unsigned)c->wgrad > MOK_WGRAD_FP32_ACCUM) want(w, "cfg.wgrad", ARG, "cfg.wgrad");
  if ((unsigned)c->numerics > MOK_NUMERICS_EXACT) want(w, "cfg.numerics", ARG, "cfg.numerics");
  const int backend_ok = (unsigned)c->backend <= MOK_BACKEND_CUDA;
  if (!backend_ok) want(w, "cfg.backend", ARG, "cfg.backend");
  if (c->num_threads < 0) want(w, "cfg.num_threads < 0", ARG, "cfg.num_threads");
  if (c->num_threads > MOK_MAX_THREADS) want(w, "cfg.num_threads > MOK_MAX_THREADS", ARG, "cfg.num_threads");
  if (!isfinite(c->route_scale)) want(w, "cfg.route_scale not finite", NONFINITE, "cfg.route_scale");
  if (!isfinite(c->aux_loss_coef)) want(w, "cfg.aux_loss_coef not finite", NONFINITE, "cfg.aux_loss_coef");
  if (!isfinite(c->z_loss_coef)) want(w, "cfg.z_loss_coef not finite", NONFINITE, "cfg.z_loss_coef");
  if (!isfinite(c->comm_timeout_s) || c->comm_timeout_s < 0)
    want(w, "cfg.comm_timeout_s", NONFINITE, "cfg.comm_timeout_s");
  if (c->numerics == MOK_NUMERICS_EXACT && backend_ok && c->backend != MOK_BACKEND_CPU)
    want(w, "EXACT numerics off the CPU", ARG, "cfg.numerics");
  if (c->num_ctas < 0) want(w, "cfg.num_ctas < 0", ARG, "cfg.num_ctas");
  if ((unsigned)c->cta_pairs > MOK_CTA_PAIRS_ON) want(w, "cfg.cta_pairs", ARG, "cfg.cta_pairs");
  if ((unsigned)c->gate_up > MOK_GATE_UP_RECOMPUTE) want(w, "cfg.gate_up", ARG, "cfg.gate_up");
  if ((unsigned)c->saved_use > MOK_SAVED_REUSE) want(w, "cfg.saved_use", ARG, "cfg.saved_use");
  /* group-limited routing (mok.h cfg.n_group; api.c validate_groups, one verdict of these) */
  if ((unsigned)c->group_score > MOK_GROUP_SCORE_MAX) want(w, "cfg.group_score", ARG, "cfg.group_score");
  if (c->n_group < 0) want(w, "cfg.n_group < 0", SHAPE, "cfg.n_group");
  else if (c->n_group == 0) {
    if (c->topk_group != 0) want(w, "cfg.topk_group without groups", SHAPE, "cfg.topk_group");
  } else if (c->E >= 1 && c->E % c->n_group) want(w, "cfg.n_group not dividing E", SHAPE, "cfg.n_group");
  else if (c->topk_group < 1 || c->topk_group > c->n_group)
    want(w, "cfg.topk_group outside [1, n_group]", SHAPE, "cfg.topk_group");
  else if (c->E >= 1 && c->K > (int64_t)c->topk_group * (c->E / c->n_group))
    want(w, "cfg.K above the kept groups' experts", SHAPE, "cfg.K");
  else if (c->routing != MOK_ROUTING_FUSED) want(w, "groups in replay routing", ARG, "cfg.n_group");
  /* the router and expert variants (mok.h; api.c validate_variants) */
  if (c->use_router_bias && c->routing != MOK_ROUTING_FUSED)
    want(w, "router bias in replay routing", ARG, "cfg.use_router_bias");
  if ((unsigned)c->activation > MOK_ACTIVATION_SWIGLU_CLAMPED) want(w, "cfg.activation", ARG, "cfg.activation");
  else if (c->activation == MOK_ACTIVATION_SWIGLU_CLAMPED) {
    if (!isfinite(c->swiglu_alpha)) want(w, "cfg.swiglu_alpha not finite", NONFINITE, "cfg.swiglu_alpha");
    else if (!(c->swiglu_alpha > 0)) want(w, "cfg.swiglu_alpha <= 0", ARG, "cfg.swiglu_alpha");
    if (!isfinite(c->swiglu_limit)) want(w, "cfg.swiglu_limit not finite", NONFINITE, "cfg.swiglu_limit");
    else if (!(c->swiglu_limit > 0)) want(w, "cfg.swiglu_limit <= 0", ARG, "cfg.swiglu_limit");
  } else if (c->swiglu_alpha != 0 || c->swiglu_limit != 0)
    want(w, "clamped SwiGLU parameters without it", ARG, "cfg.swiglu_alpha|cfg.swiglu_limit");
  if (c->use_shared_gate && c->Fs == 0) want(w, "shared gate without a shared expert", ARG, "cfg.use_shared_gate");
#ifndef MOK_HAVE_CUDA
  if (c->backend == MOK_BACKEND_CUDA) want(w, "no CUDA backend", MOK_STATUS_BACKEND_UNAVAILABLE, "cfg.backend");
#endif
  if (c->E > MOK_MAX_EXPERTS) want(w, "cfg.E > MOK_MAX_EXPERTS", UNSUPPORTED, "cfg.E");
  /* sizes: a dimension beyond int32 is absurd (UNSUPPORTED, or INVALID_SHAPE); one
   * within it but large may fit or not (its buffers against 2^48 bytes and memory) */
  const int64_t dims[] = {c->T, c->H, c->F, c->Fs};
  int64_t largest = 0;
  for (int i = 0; i < 4; i++) largest = dims[i] > largest ? dims[i] : largest;
  const mok_status_t absurd[] = {UNSUPPORTED, SHAPE};
  if (largest > INT32_MAX) want_any(w, "absurd shape", absurd, 2, "cfg.T|cfg.H|cfg.F|cfg.Fs|cfg.E|cfg.K");
  else if (w_ok && c->K >= 1 && (double)c->W * (double)c->T * (double)c->K >= 2147483647.0)
    want(w, "W T K rows beyond int32", UNSUPPORTED, "cfg.T");
  else if (largest >= (1 << 20)) {
    const mok_status_t maybe[] = {UNSUPPORTED, SHAPE, MOK_STATUS_OUT_OF_MEMORY};
    want_any(w, "huge shape", maybe, 3, "cfg.T|cfg.H|cfg.F|cfg.Fs|cfg.E|cfg.K|memory");
    w->may_succeed = 1;
  }
  if (w_ok && c->W > 1 && !c->cpu_comm && c->backend == MOK_BACKEND_CPU)
    want(w, "cfg.cpu_comm NULL", ARG, "cfg.cpu_comm");
  if (w_ok && c->cpu_comm && comm_ranks != c->W) want(w, "cfg.cpu_comm of other ranks", ARG, "cfg.cpu_comm");
}

/* The fields every rank must agree on (mok.h: the layer), as a rank compares them. */
static int same_layer(const mok_config_t* a, const mok_config_t* b) {
  return a->H == b->H && a->F == b->F && a->E == b->E && a->K == b->K && a->W == b->W && a->routing == b->routing &&
         a->score == b->score && a->normalize == b->normalize && a->route_scale == b->route_scale &&
         a->use_bias_select == b->use_bias_select && a->aux_loss_coef == b->aux_loss_coef &&
         a->z_loss_coef == b->z_loss_coef && a->n_group == b->n_group && a->topk_group == b->topk_group &&
         a->group_score == b->group_score && a->use_router_bias == b->use_router_bias &&
         a->use_expert_bias == b->use_expert_bias && a->activation == b->activation &&
         a->swiglu_alpha == b->swiglu_alpha && a->swiglu_limit == b->swiglu_limit &&
         a->use_shared_gate == b->use_shared_gate && a->Fs == b->Fs &&
         a->numerics == b->numerics && a->wgrad == b->wgrad;
}

/* (sum of every rank's cfg.T) min(K, E / W), for a config that passed its own rules
 * (0 for one that did not; at most INT64_MAX / 4) */
static int64_t capacity_max(const mok_config_t* c, const int64_t* T_all) {
  if (c->W < 1 || c->W > kMaxCreateW || c->E < 1 || c->K < 1) return 0;
  __int128 T = 0;
  for (int r = 0; r < c->W; r++) {
    if (T_all[r] < 0) return 0;
    T += T_all[r];
  }
  const int64_t El = c->E / c->W;
  const __int128 most = T * (c->K < El ? c->K : El);
  return most > INT64_MAX / 4 ? INT64_MAX / 4 : (int64_t)most;
}

/* What each of the W ranks' creates gives (want[r]): their own rules; when every rank
 * passes them, attach's one verdict for all (the layers agree, every capacity within
 * (sum of cfg.T) min(K, E / W)); when only some pass, those wait for the others in
 * attach and time out. */
static void want_create(const fz_create_t* c, int W, const int* comm_ranks, fz_want_t* want_r) {
  int failing = 0;
  for (int r = 0; r < W; r++) {
    memset(&want_r[r], 0, sizeof want_r[r]);
    want_create_local(&c[r].cfg, comm_ranks[r], &want_r[r]);
    failing += want_r[r].n > 0 && !want_r[r].may_succeed;
  }
  if (failing == W) return;
  if (failing > 0) {
    for (int r = 0; r < W; r++)
      if (want_r[r].n == 0 || want_r[r].may_succeed)
        want(&want_r[r], "a peer failed its create", MOK_STATUS_COMM_TIMEOUT, "comm_timeout_s|arrive");
    return;
  }
  int64_t T_all[kMaxCreateW];
  int mismatch = 0, over = 0;
  for (int r = 0; r < W; r++) T_all[r] = c[r].cfg.T;
  for (int r = 0; r < W; r++) {
    mismatch |= !same_layer(&c[0].cfg, &c[r].cfg);
    over |= !want_r[r].may_succeed && c[r].cfg.capacity > capacity_max(&c[0].cfg, T_all);
  }
  for (int r = 0; r < W; r++) {
    if (mismatch) want(&want_r[r], "ranks' layers differ", MOK_STATUS_INVALID_ARGUMENT, "differs");
    if (over && !mismatch)
      want(&want_r[r], "cfg.capacity > (sum of cfg.T) min(K, E/W)", MOK_STATUS_INVALID_SHAPE, "cfg.capacity");
  }
}

/* ---- case: create ---- */

/* A valid layer for W ranks, small, with random router and execution choices. */
static void random_layer(uint64_t* s, int W, int64_t max_E, mok_config_t* c) {
  *c = (mok_config_t)MOK_CONFIG_INIT;
  c->H = small_dim(s, 64);
  c->F = small_dim(s, 64);
  c->E = W * rnd_in(s, 1, max_E / W > 0 ? max_E / W : 1);
  c->K = pct(s, 10) ? c->E : rnd_in(s, 1, c->E < 8 ? c->E : 8);
  c->W = W;
  c->Fs = pct(s, 40) ? 0 : small_dim(s, 64);
  c->routing = pct(s, 40) ? MOK_ROUTING_REPLAY : MOK_ROUTING_FUSED;
  c->score = pct(s, 50) ? MOK_SCORE_SIGMOID : MOK_SCORE_SOFTMAX;
  c->normalize = pct(s, 60);
  c->route_scale = (float)PICK(s, 4, 4, 4, 2, 10, 1, -5, 0) / 4.0f;
  c->use_bias_select = pct(s, 50);
  c->aux_loss_coef = pct(s, 50) ? 0.0f : (float)PICK(s, 1, 10, 100, -50) * 1e-3f;
  c->z_loss_coef = pct(s, 50) ? 0.0f : (float)PICK(s, 1, 10, 100, -50) * 1e-3f;
  c->wgrad = pct(s, 40) ? MOK_WGRAD_FP32_ACCUM : MOK_WGRAD_BF16;
  c->numerics = pct(s, 15) ? MOK_NUMERICS_EXACT : MOK_NUMERICS_BF16;
  c->gate_up = pct(s, 40) ? MOK_GATE_UP_RECOMPUTE : MOK_GATE_UP_SAVE;
  c->saved_use = pct(s, 40) ? MOK_SAVED_REUSE : MOK_SAVED_KEEP;
  c->num_ctas = (int)PICK(s, 0, 0, 1, 132, INT_MAX);
  c->cta_pairs = (mok_cta_pairs_t)rnd_in(s, 0, 2);
  if (c->routing == MOK_ROUTING_FUSED && pct(s, 35)) { /* group-limited: a divisor of E, K within the kept groups */
    int64_t groups;
    do groups = rnd_in(s, 1, c->E);
    while (c->E % groups);
    const int64_t size = c->E / groups;
    c->n_group = (int)groups;
    c->topk_group = (int)rnd_in(s, (c->K + size - 1) / size, groups);
    c->group_score = pct(s, 30) ? MOK_GROUP_SCORE_MAX : MOK_GROUP_SCORE_TOP2;
  }
  /* the router and expert variants, each on now and then */
  c->use_router_bias = c->routing == MOK_ROUTING_FUSED && pct(s, 30);
  c->use_expert_bias = pct(s, 30);
  if (pct(s, 30)) { /* gpt-oss's clamped SwiGLU, its limit at times among the values */
    c->activation = MOK_ACTIVATION_SWIGLU_CLAMPED;
    c->swiglu_alpha = (float)PICK(s, 1702, 1702, 1000, 500, 3000) / 1000.0f;
    c->swiglu_limit = (float)PICK(s, 7000, 7000, 250, 1000, 10) / 1000.0f;
  }
  c->use_shared_gate = c->Fs > 0 && pct(s, 30);
}

static int64_t absurd_dim(uint64_t* s) {
  return PICK(s, (int64_t)1 << 40, (int64_t)1 << 53, ((int64_t)1 << 53) + 1, (int64_t)1 << 62, INT64_MAX,
              ((int64_t)1 << 40) + rnd_in(s, 0, (int64_t)1 << 40), (int64_t)INT32_MAX + 1);
}

typedef enum {
  C_VALID, C_VERSION, C_STRUCT_SIZE, C_T, C_H, C_F, C_E, C_K, C_W, C_E_MOD_W, C_FS, C_CAPACITY_NEG,
  C_CAPACITY_HIGH, C_RANK, C_ROUTING, C_SCORE, C_WGRAD, C_NUMERICS, C_BACKEND, C_THREADS, C_ROUTE_SCALE, C_AUX,
  C_Z, C_TIMEOUT, C_EXACT_CUDA, C_CTAS, C_CTA_PAIRS, C_GATE_UP, C_SAVED_USE, C_N_GROUP, C_TOPK_GROUP, C_GROUP_K,
  C_GROUP_SCORE, C_GROUP_REPLAY, C_ROUTER_BIAS_REPLAY, C_ACTIVATION, C_SWIGLU_ALPHA, C_SWIGLU_LIMIT, C_SWIGLU_OFF, C_SHARED_GATE_NO_FS, C_E_MAX, C_ABSURD, C_HUGE, C_COMM_NULL, C_COMM_WRONG, C_COMM_FAKE, C_EXTREME,
  C_NUM_MUTATIONS
} create_mutation_t;

static const char* const kCreateMutation[] = {
    "valid", "version", "struct_size", "T", "H", "F", "E", "K", "W", "E % W", "Fs", "capacity < 0",
    "capacity > max", "rank", "routing", "score", "wgrad", "numerics", "backend", "num_threads", "route_scale",
    "aux_loss_coef", "z_loss_coef", "comm_timeout_s", "EXACT on CUDA", "num_ctas", "cta_pairs", "gate_up",
    "saved_use", "n_group", "topk_group", "K > kept groups' experts", "group_score", "groups in replay",
    "router bias in replay", "activation", "swiglu_alpha", "swiglu_limit", "swiglu parameters without it", "shared gate without Fs", "E > max", "absurd shape", "huge shape", "cpu_comm NULL", "cpu_comm of other ranks",
    "cpu_comm fake", "valid extremes"};

static const float kNonfinite[] = {NAN, INFINITY, -INFINITY};

typedef struct {
  int W;                          /* ranks (threads) */
  fz_create_t c[kMaxCreateW];
  int comm_ranks[kMaxCreateW];    /* what cfg.cpu_comm is, for the predicate */
  mok_cpu_comm_t* comm;           /* the W ranks' communicator (W > 1) */
  mok_cpu_comm_t* other;          /* one of other ranks, when used */
  void* fake;                     /* zeroed memory posing as a communicator */
} fz_creates_t;

/* Applies mutation m to every rank alike (rank: each its own wrong one). */
static void mutate_config(uint64_t* s, create_mutation_t m, fz_creates_t* x) {
  const int W = x->W;
  const int64_t enum_bad = PICK(s, 2, 3, 7, 1000, -1, INT_MAX, INT_MIN);
  const int64_t neg = PICK(s, -1, -2, -64, INT64_MIN, -rnd_in(s, 1, 1 << 20));
  const float nf = kNonfinite[rnd(s) % 3];
  int64_t T_all[kMaxCreateW] = {0};
  for (int r = 0; r < W; r++) T_all[r] = x->c[r].cfg.T;
  const int64_t cap_bad = capacity_max(&x->c[0].cfg, T_all) + PICK(s, 1, 1, 2, 64, (int64_t)1 << 40);
  const int64_t cap_huge = PICK(s, cap_bad, (int64_t)1 << 62, INT64_MAX, cap_bad);
  const int64_t absurd = absurd_dim(s);
  const int which_dim = (int)rnd_in(s, 0, 3);
  const int64_t huge = PICK(s, 1 << 20, INT32_MAX, INT32_MAX - rnd_in(s, 0, 1 << 20), 1 << 24);
  const int one_rank = (int)rnd_in(s, 0, W - 1); /* capacity: the bound is checked for every rank's */
  const mok_config_t* c0 = &x->c[0].cfg; /* (the layer, alike on every rank) */
  int64_t no_divisor = c0->E + 1; /* n_group: one that does not divide E, or a negative one */
  while (c0->E >= 2 && c0->E % (no_divisor = rnd_in(s, 2, c0->E + 8)) == 0) continue;
  const int64_t bad_groups = PICK(s, -1, INT_MIN, no_divisor, no_divisor, c0->E + 1, INT_MAX);
  const int64_t bad_topk = c0->n_group == 0 ? PICK(s, 1, -1, INT_MAX) : PICK(s, 0, -1, c0->n_group + 1, INT_MAX);
  const int64_t kept = c0->E >= 2 ? rnd_in(s, 1, c0->E - 1) : 1; /* groups of 1, so many kept */
  for (int r = 0; r < W; r++) {
    mok_config_t* c = &x->c[r].cfg;
    switch (m) {
      case C_VALID: break;
      case C_VERSION: c->version = (int)PICK(s, MOK_VERSION_CODE + 1, MOK_VERSION_CODE - 100, 0, -1); break;
      case C_STRUCT_SIZE: c->struct_size = sizeof(mok_config_t) + (size_t)PICK(s, 8, -8, -1, 4096); break;
      case C_T: c->T = neg; break;
      case C_H: c->H = PICK(s, 0, neg); break;
      case C_F: c->F = PICK(s, 0, neg); break;
      case C_E: c->E = PICK(s, 0, neg); break;
      case C_K: c->K = PICK(s, 0, neg, c->E + 1, c->E + 1000, INT64_MAX); break;
      case C_W: c->W = (int)PICK(s, 0, -1, MOK_MAX_RANKS + 1, 1000, INT_MAX, INT_MIN); break;
      case C_E_MOD_W: c->E = c->E + 1; break; /* (W > 1 only) */
      case C_FS: c->Fs = neg; break;
      case C_CAPACITY_NEG: c->capacity = neg; break;
      case C_CAPACITY_HIGH: if (r == one_rank || pct(s, 30)) c->capacity = cap_huge; break;
      case C_RANK: c->rank = (int)PICK(s, -1, W, W + 1, INT_MAX, INT_MIN, -1000); break;
      case C_ROUTING: c->routing = (mok_routing_t)enum_bad; break;
      case C_SCORE: c->score = (mok_score_t)enum_bad; break;
      case C_WGRAD: c->wgrad = (mok_wgrad_t)enum_bad; break;
      case C_NUMERICS: c->numerics = (mok_numerics_t)enum_bad; break;
      case C_BACKEND: c->backend = (mok_backend_t)PICK(s, 2, 3, -1, INT_MAX, INT_MIN); break;
      case C_THREADS: c->num_threads = (int)PICK(s, -1, INT_MIN, MOK_MAX_THREADS + 1, INT_MAX, 5000); break;
      case C_ROUTE_SCALE: c->route_scale = nf; break;
      case C_AUX: c->aux_loss_coef = nf; break;
      case C_Z: c->z_loss_coef = nf; break;
      case C_TIMEOUT: c->comm_timeout_s = PICK(s, 0, 1, 2, 3) == 0 ? -1.0 : (double)nf; break;
      case C_EXACT_CUDA: c->numerics = MOK_NUMERICS_EXACT, c->backend = MOK_BACKEND_CUDA; break;
      case C_CTAS: c->num_ctas = (int)PICK(s, -1, INT_MIN); break;
      case C_CTA_PAIRS: c->cta_pairs = (mok_cta_pairs_t)PICK(s, 3, 4, -1, INT_MAX); break;
      case C_GATE_UP: c->gate_up = (mok_gate_up_t)enum_bad; break;
      case C_SAVED_USE: c->saved_use = (mok_saved_use_t)enum_bad; break;
      case C_N_GROUP: c->n_group = (int)bad_groups, c->topk_group = 1; break;
      case C_TOPK_GROUP: c->topk_group = (int)bad_topk; break;
      case C_GROUP_K: /* (E = 1: no K can exceed the kept experts, so a group count that does not divide E) */
        if (c->E >= 2) c->n_group = (int)c->E, c->topk_group = (int)kept, c->K = kept + 1;
        else c->n_group = 2, c->topk_group = 1;
        break;
      case C_GROUP_SCORE: c->group_score = (mok_group_score_t)enum_bad; break;
      case C_GROUP_REPLAY:
        c->routing = MOK_ROUTING_REPLAY;
        if (c->n_group == 0) c->n_group = c->topk_group = 1;
        break;
      case C_ROUTER_BIAS_REPLAY: c->routing = MOK_ROUTING_REPLAY, c->use_router_bias = 1; break;
      case C_ACTIVATION: c->activation = (mok_activation_t)enum_bad; break;
      case C_SWIGLU_ALPHA: /* not finite, or not > 0 */
        c->activation = MOK_ACTIVATION_SWIGLU_CLAMPED, c->swiglu_limit = 7.0f;
        c->swiglu_alpha = pct(s, 50) ? nf : (float)PICK(s, 0, -1, -1000) * (pct(s, 20) ? -0.0f : 1.0f);
        break;
      case C_SWIGLU_LIMIT:
        c->activation = MOK_ACTIVATION_SWIGLU_CLAMPED, c->swiglu_alpha = 1.702f;
        c->swiglu_limit = pct(s, 50) ? nf : pct(s, 20) ? -0.0f : (float)PICK(s, 0, -1, -7);
        break;
      case C_SWIGLU_OFF: /* the plain SwiGLU with a parameter of the clamped one */
        c->activation = MOK_ACTIVATION_SWIGLU;
        if (pct(s, 50)) c->swiglu_alpha = pct(s, 20) ? nf : 1.702f;
        else c->swiglu_limit = 7.0f;
        break;
      case C_SHARED_GATE_NO_FS: c->use_shared_gate = 1, c->Fs = 0; break;
      case C_E_MAX: c->E = (MOK_MAX_EXPERTS / W + PICK(s, 1, 2, 1000)) * W; break;
      case C_ABSURD:
        if (which_dim == 0) c->T = absurd;
        else if (which_dim == 1) c->H = absurd;
        else if (which_dim == 2) c->F = absurd;
        else c->Fs = absurd;
        break;
      case C_HUGE: /* no tokens, so that nothing is allocated for them */
        c->T = 0, c->capacity = 0;
        if (which_dim == 1) c->H = huge;
        else if (which_dim == 2) c->F = huge;
        else c->Fs = huge;
        break;
      case C_COMM_NULL: c->cpu_comm = NULL; break;
      case C_COMM_WRONG: c->cpu_comm = x->other; break;
      case C_COMM_FAKE: c->cpu_comm = x->fake; break;
      case C_EXTREME: break; /* set by the caller */
      case C_NUM_MUTATIONS: break;
    }
  }
}

static int create_iteration(fz_log_t* L, uint64_t seed) {
  uint64_t s = seed;
  fz_creates_t* x = calloc(1, sizeof *x);
  if (!x) abort();
  const int W = (int)PICK(&s, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 4, 4, 4, 8, 8) * (pct(&s, 2) ? 0 : 1);
  x->W = W ? W : 64; /* now and then every rank MOK_MAX_RANKS allows */
  mok_config_t layer;
  random_layer(&s, x->W, x->W == 64 ? 64 : 128, &layer);
  /* the mutation: mostly one rule, some valid configs, a few with two or three rules */
  create_mutation_t muts[3] = {C_VALID, C_VALID, C_VALID};
  int num_muts = pct(&s, 12) ? 0 : pct(&s, 90) ? 1 : (int)rnd_in(&s, 2, 3);
  for (int i = 0; i < num_muts; i++) {
    do muts[i] = (create_mutation_t)rnd_in(&s, C_VERSION, C_NUM_MUTATIONS - 1);
    while ((muts[i] == C_E_MOD_W && x->W == 1) || (num_muts > 1 && (muts[i] == C_HUGE || muts[i] == C_EXTREME))
#ifdef MOK_HAVE_CUDA
           || muts[i] == C_EXACT_CUDA /* (a CUDA build creates CUDA contexts: not this suite's) */
#endif
    );
  }
  if (num_muts == 0) num_muts = 1; /* C_VALID */
  for (int r = 0; r < x->W; r++) {
    mok_config_t* c = &x->c[r].cfg;
    *c = layer;
    c->rank = r;
    c->T = pct(&s, 10) ? 0 : rnd_in(&s, 0, 300);
    c->num_threads = (int)PICK(&s, 0, 1, 1, 2, 3);
    c->comm_timeout_s = x->W > 1 ? 2.0 : (double)PICK(&s, 0, 1, 5);
  }
  if (muts[0] == C_HUGE) /* every rank alike, so that they all take the same verdict */
    for (int r = 1; r < x->W; r++) x->c[r].cfg.T = x->c[0].cfg.T;
  int64_t T_all[kMaxCreateW];
  for (int r = 0; r < x->W; r++) T_all[r] = x->c[r].cfg.T;
  const int64_t cap_max = capacity_max(&layer, T_all);
  for (int r = 0; r < x->W; r++)
    x->c[r].cfg.capacity = pct(&s, 50) ? 0 : pct(&s, 20) ? cap_max : rnd_in(&s, 0, cap_max);
  if (x->W > 1 && mok_cpu_comm_create(x->W, &x->comm)) abort();
  for (int r = 0; r < x->W; r++) x->c[r].cfg.cpu_comm = x->comm;
  if (x->W == 1 && pct(&s, 20) && mok_cpu_comm_create(1, &x->comm) == MOK_STATUS_SUCCESS)
    x->c[0].cfg.cpu_comm = x->comm; /* W = 1 may pass a communicator of one rank */
  if (mok_cpu_comm_create(x->W == 2 ? 3 : 2, &x->other)) abort();
  x->fake = calloc(1, 1 << 16);
  if (!x->fake) abort();
  for (int i = 0; i < num_muts; i++) mutate_config(&s, muts[i], x);
  if (muts[0] == C_EXTREME) { /* valid values at the edges of their ranges */
    for (int r = 0; r < x->W; r++) {
      mok_config_t* c = &x->c[r].cfg;
      const float fv[] = {FLT_MAX, -FLT_MAX, FLT_MIN, 1e-45f, -0.0f, 0.0f};
      c->route_scale = fv[rnd(&s) % 6];
      c->aux_loss_coef = fv[rnd(&s) % 6];
      c->z_loss_coef = fv[rnd(&s) % 6];
      c->num_ctas = INT_MAX;
      c->capacity = cap_max;
      if (x->W == 1) c->comm_timeout_s = (double)PICK(&s, 0, 1, 2) == 0 ? 1e-300 : DBL_MAX;
      if (x->W == 1 && pct(&s, 10)) c->num_threads = MOK_MAX_THREADS;
      if (x->W == 1 && pct(&s, 20)) /* (groups: 8 of 128, DeepSeek-V3's 4 kept) */
        c->E = MOK_MAX_EXPERTS, c->K = rnd_in(&s, 1, 4), c->n_group = c->n_group ? 8 : 0, c->topk_group = c->n_group ? 4 : 0;
    }
    /* (the ranks must agree on the layer: the same extremes for all) */
    for (int r = 1; r < x->W; r++) {
      x->c[r].cfg.route_scale = x->c[0].cfg.route_scale;
      x->c[r].cfg.aux_loss_coef = x->c[0].cfg.aux_loss_coef;
      x->c[r].cfg.z_loss_coef = x->c[0].cfg.z_loss_coef;
    }
  }
  const int mismatch = x->W > 1 && num_muts == 1 && muts[0] == C_VALID && pct(&s, 40);
  if (mismatch) { /* one rank's layer differs in one field */
    mok_config_t* c = &x->c[rnd_in(&s, 0, x->W - 1)].cfg;
    switch (rnd_in(&s, 0, 12)) {
      case 0: c->H += 1; break;
      case 1: c->F += 1; break;
      case 2: c->K = c->K > 1 ? c->K - 1 : 1 + (c->E > 1); break;
      case 3: c->routing = (mok_routing_t)!c->routing; break;
      case 4: c->route_scale += 1.0f; break;
      case 5: c->Fs += 1; break;
      case 6: c->wgrad = (mok_wgrad_t)!c->wgrad; break;
      case 7: c->group_score = (mok_group_score_t)!c->group_score; break;
      case 8: /* (replay: a rank that fails its own rule; another field instead) */
        if (c->routing == MOK_ROUTING_FUSED) c->use_router_bias = !c->use_router_bias;
        else c->aux_loss_coef += 0.5f;
        break;
      case 9: c->use_expert_bias = !c->use_expert_bias; break;
      case 10: /* (the clamped SwiGLU's limit, where it is on; else the activation itself) */
        if (c->activation == MOK_ACTIVATION_SWIGLU_CLAMPED) c->swiglu_limit *= 2.0f;
        else c->activation = MOK_ACTIVATION_SWIGLU_CLAMPED, c->swiglu_alpha = 1.702f, c->swiglu_limit = 7.0f;
        break;
      case 11: /* (no shared expert: a rank that fails its own rule; another field instead) */
        if (c->Fs > 0) c->use_shared_gate = !c->use_shared_gate;
        else c->aux_loss_coef += 0.5f;
        break;
      default: c->aux_loss_coef += 0.5f; break;
    }
  }
  for (int r = 0; r < x->W; r++) {
    const void* cc = x->c[r].cfg.cpu_comm;
    x->comm_ranks[r] = !cc ? 0 : cc == x->fake ? -1 : cc == (void*)x->other ? (x->W == 2 ? 3 : 2) : x->comm ? x->W : 1;
  }
  char* d = L->desc;
  int at = snprintf(d, sizeof L->desc, "W = %d, %s%s%s%s%s%s, rank 0: ", x->W, kCreateMutation[muts[0]],
                    num_muts > 1 ? " + " : "", num_muts > 1 ? kCreateMutation[muts[1]] : "",
                    num_muts > 2 ? " + " : "", num_muts > 2 ? kCreateMutation[muts[2]] : "",
                    mismatch ? " (one rank's layer differs)" : "");
  describe_cfg(d + at, sizeof L->desc - (size_t)at, &x->c[0].cfg);
  at = (int)strlen(d);
  for (int r = 1; r < x->W && r < 8 && at < (int)sizeof L->desc - 64; r++)
    at += snprintf(d + at, sizeof L->desc - (size_t)at, "; rank %d: T=%lld capacity=%lld rank=%d", r,
                   (long long)x->c[r].cfg.T, (long long)x->c[r].cfg.capacity, x->c[r].cfg.rank);

  fz_want_t* w = calloc(kMaxCreateW, sizeof *w);
  if (!w) abort();
  want_create(x->c, x->W, x->comm_ranks, w);
  on_ranks(x->W, op_create, x->c, sizeof x->c[0]);
  int bad = 0;
  for (int r = 0; r < x->W; r++) {
    fz_create_t* c = &x->c[r];
    bad += check_status(L, "mok_context_create", r, &w[r], c->status, c->msg);
    if (c->status != MOK_STATUS_SUCCESS) {
      if (c->ctx) fz_fail(L, "*ctx not NULL after a failed create", "rank %d: *ctx = %p", r, (void*)c->ctx);
      c->ctx = NULL;
      continue;
    }
    if (w[r].n && !w[r].may_succeed) continue; /* (reported; destroyed below, not used) */
    size_t ws = 0, sv = 0;
    mok_status_t s1 = mok_workspace_size(c->ctx, &ws), s2 = mok_saved_size(c->ctx, &sv);
    if (s1 || s2 || !sv)
      fz_fail(L, "sizes of a created context", "rank %d: mok_workspace_size %s (%zu), mok_saved_size %s (%zu)", r,
              sname(s1), ws, sname(s2), sv);
  }
  for (int r = 0; r < x->W; r++)
    if (!x->c[r].ctx) x->c[r].status = MOK_STATUS_SUCCESS; /* (now destroy's status) */
  on_ranks(x->W, op_destroy, x->c, sizeof x->c[0]);
  for (int r = 0; r < x->W; r++)
    if (x->c[r].status != MOK_STATUS_SUCCESS)
      fz_fail(L, "mok_context_destroy", "rank %d: %s", r, sname(x->c[r].status));
  if (x->comm) mok_cpu_comm_destroy(x->comm);
  mok_cpu_comm_destroy(x->other);
  free(x->fake);
  free(w);
  free(x);
  return bad;
}

/* Two ranks of W claim one rank: the second to attach gets COMM_ERROR naming cfg.rank,
 * every other waits for the missing rank and times out. */
static void create_duplicate_rank(fz_log_t* L, uint64_t seed) {
  uint64_t s = seed;
  const int W = (int)rnd_in(&s, 2, 4);
  fz_creates_t* x = calloc(1, sizeof *x);
  if (!x || mok_cpu_comm_create(W, &x->comm)) abort();
  mok_config_t layer;
  random_layer(&s, W, 32, &layer);
  const int a = (int)rnd_in(&s, 0, W - 1), b = (a + 1 + (int)rnd_in(&s, 0, W - 2)) % W;
  for (int r = 0; r < W; r++) {
    x->c[r].cfg = layer;
    x->c[r].cfg.T = rnd_in(&s, 0, 64);
    x->c[r].cfg.rank = r == b ? a : r;
    x->c[r].cfg.cpu_comm = x->comm;
    x->c[r].cfg.comm_timeout_s = 0.2;
    x->c[r].cfg.num_threads = 1;
  }
  snprintf(L->desc, sizeof L->desc, "duplicate rank: W = %d, threads %d and %d both rank %d", W, a, b, a);
  on_ranks(W, op_create, x->c, sizeof x->c[0]);
  int errors = 0;
  for (int r = 0; r < W; r++) {
    fz_create_t* c = &x->c[r];
    fz_want_t w = {0};
    if (c->status == MOK_STATUS_COMM_ERROR && (r == a || r == b)) {
      errors++;
      want(&w, "duplicate rank", MOK_STATUS_COMM_ERROR, "cfg.rank");
    } else {
      want(&w, "duplicate rank: the others time out", MOK_STATUS_COMM_TIMEOUT, "comm_timeout_s|arrive");
    }
    check_status(L, "mok_context_create", r, &w, c->status, c->msg);
    if (c->status) c->ctx = NULL;
  }
  if (errors != 1) fz_fail(L, "duplicate rank", "%d ranks returned COMM_ERROR, want 1", errors);
  on_ranks(W, op_destroy, x->c, sizeof x->c[0]);
  mok_cpu_comm_destroy(x->comm);
  free(x);
}

static int fuzz_create(void) {
  fz_log_t L;
  log_begin(&L, 0.2);
  while (log_next(&L)) {
    uint64_t seed = iteration_seed(&L);
    if (seed % 64 == 0) create_duplicate_rank(&L, seed);
    else create_iteration(&L, seed);
  }
  return log_end(&L, 1);
}

/* ---- a world: W ranks' contexts and buffers over one global batch ---- */

enum {
  B_X, B_WR, B_BIAS, B_BR, B_W13, B_W2, B_B13, B_B2, B_WS13, B_WS2, B_WSG, B_DY, B_DAUX, B_DZ, /* inputs */
  B_IDX, B_TW,                                                      /* replay inputs, fused outputs */
  B_Y, B_TPE, B_AUX, B_Z, B_SAVED, B_SAVED2,                        /* forward outputs; a second saved */
  B_DX, B_DTW, B_DWR, B_DBR, B_DW13, B_DW2, B_DB13, B_DB2, B_DWSG, B_DWS13, B_DWS2, /* backward outputs (gradients: B_DWR ..) */
  B_WS, B_WS_BWD,                                                   /* workspaces: not compared */
  B_NUM
};
static const char* const kBufName[B_NUM] = {
    "x", "w_router", "bias_select", "b_router", "w13", "w2", "b13", "b2", "ws13", "ws2", "w_sg", "dy", "d_aux_loss", "d_z_loss",
    "topk_idx", "topk_weight", "y", "tokens_per_expert", "aux_loss", "z_loss", "saved", "saved (second)", "dx",
    "d_topk_weight", "d_w_router", "d_b_router", "d_w13", "d_w2", "d_b13", "d_b2", "d_w_sg", "d_ws13", "d_ws2", "workspace",
    "backward workspace"};

typedef struct {
  unsigned char* p;      /* bytes + kSlack, 256-byte aligned */
  size_t bytes;
  int kind;              /* mok_tensor_view_t's: 0 bf16, 1 fp32, 2 double, 3 int32 */
  size_t elem;
  unsigned char* before; /* what it held before the call, slack included */
} fz_buf_t;

/* What the test knows of a saved buffer of a rank (B_SAVED, B_SAVED2). */
enum { SAVED_BAD, SAVED_OK, SAVED_EITHER }; /* EITHER: altered where the check need not look */
typedef struct {
  int state;
  int64_t n;  /* num_tokens of the forward that wrote it */
  int used;   /* MOK_SAVED_REUSE: used up by a backward */
} fz_saved_t;

typedef struct {
  fz_create_t c; /* first: op_create and op_destroy take a rank */
  int r;
  int64_t n, t0, e0;   /* tokens of the step, its first global token, first expert */
  size_t ws_bytes, sv_bytes;
  fz_buf_t b[B_NUM];
  fz_saved_t saved[2];
  mok_forward_args_t fa, fcall;   /* valid arguments, and the call's */
  mok_backward_args_t ba, bcall;
  int no_args;                    /* the call gets args = NULL */
  mok_context_t* call_ctx;        /* the call's context */
  fz_want_t w;                    /* the call's expected outcome */
  int empty;                      /* W = 1, no tokens: the empty-batch call */
} fz_rank_t;

/* optional pointers a rank's valid calls give (a bit each) */
enum {
  OPT_X0 = 1 << 0, OPT_Y0 = 1 << 1, OPT_DY0 = 1 << 2, OPT_DX0 = 1 << 3, OPT_WR = 1 << 4, OPT_BIAS = 1 << 5,
  OPT_SHARED = 1 << 6, OPT_IDX = 1 << 7, OPT_TPE = 1 << 8, OPT_AUX = 1 << 9, OPT_Z = 1 << 10, OPT_DWR = 1 << 11,
  OPT_IDX0 = 1 << 12, OPT_DTW0 = 1 << 13,
  OPT_VAR_IN = 1 << 14, /* the variants' input tensors given when off too */
  OPT_DBR = 1 << 15     /* d_b_router given (written with use_router_bias, else left) */
};

typedef struct {
  int W;
  mok_config_t layer;           /* every rank's layer (cfg T, rank, comm, capacity, threads per rank) */
  int64_t n[kMaxW], T[kMaxW];   /* num_tokens and cfg.T of each rank */
  int cap_mode[kMaxW];          /* capacity: 0 the default, 1 enough for the step, 2 any in [0, max] */
  int threads[kMaxW];
  unsigned opt[kMaxW];
  double timeout;
  int d_loss_null;              /* backward's d_aux_loss, d_z_loss NULL (the reference passes 1) */
  int same_ws;                  /* backward in the forward's workspace */
  int ref_threads;              /* the W = 1 reference run's */
  mok_gate_up_t ref_gate_up;
  mok_saved_use_t ref_saved_use;
  uint64_t data_seed;
} fz_plan_t;

typedef struct {
  fz_plan_t pl;
  int W;
  fz_rank_t rk[kMaxW];
  mok_cpu_comm_t* comm;
  mok_problem_t* p;      /* the global batch; after world_reference, the W = 1 run's outputs */
  int64_t T_global, E, El, H, F, K, Fs;
  size_t act, real, wg;
  int fused, losses, aligned, accum;
  int64_t rows_to[kMaxW];    /* rows each rank's experts receive in the valid step */
  int64_t capacity[kMaxW];   /* each rank's, resolved (0: the bound) */
  int values_differ;         /* saved altered where unchecked: backward outputs 1 finite, 2 anything */
} fz_world_t;

static size_t rounded(size_t bytes) { return (bytes + kSlack + 255) / 256 * 256; }

static void buf_alloc(fz_buf_t* b, size_t bytes, int kind, size_t elem) {
  b->bytes = bytes;
  b->kind = kind;
  b->elem = elem;
  b->p = aligned_alloc(256, rounded(bytes));
  b->before = malloc(rounded(bytes));
  if (!b->p || !b->before) abort();
  memset(b->p, POISON, rounded(bytes));
}

static void world_free(fz_world_t* wd) {
  for (int r = 0; r < wd->W; r++)
    for (int i = 0; i < B_NUM; i++) free(wd->rk[r].b[i].p), free(wd->rk[r].b[i].before);
  if (wd->comm) mok_cpu_comm_destroy(wd->comm);
  if (wd->p) mok_problem_destroy(wd->p);
  free(wd);
}

static void world_destroy_contexts(fz_log_t* L, fz_world_t* wd) {
  for (int r = 0; r < wd->W; r++) wd->rk[r].c.status = MOK_STATUS_SUCCESS;
  on_ranks(wd->W, op_destroy, wd->rk, sizeof wd->rk[0]);
  for (int r = 0; r < wd->W; r++)
    if (wd->rk[r].c.status) fz_fail(L, "mok_context_destroy", "rank %d: %s", r, sname(wd->rk[r].c.status));
}

static void random_plan(uint64_t* s, int W, fz_plan_t* pl) {
  memset(pl, 0, sizeof *pl);
  pl->W = W;
  random_layer(s, W, 64, &pl->layer);
  const int aligned = W > 1 && pct(s, 45);
  for (int r = 0; r < W; r++) {
    int64_t n = pct(s, 60) ? rnd_in(s, 0, 40) : pct(s, 75) ? rnd_in(s, 41, 140) : rnd_in(s, 141, 300);
    if (pct(s, 8)) n = 0;
    if (aligned && r < W - 1) n = 64 * PICK(s, 0, 1, 1, 1, 2);
    pl->n[r] = n;
    pl->T[r] = pct(s, 50) ? n : n + rnd_in(s, 1, 300 - n > 1 ? 300 - n : 1);
    pl->cap_mode[r] = pct(s, 50) ? 0 : pct(s, 60) ? 1 : 2;
    pl->threads[r] = (int)PICK(s, 1, 1, 1, 1, 1, 1, 1, 2, 2, 0);
    pl->opt[r] = (unsigned)rnd(s) | OPT_IDX | OPT_TPE | OPT_AUX | OPT_Z | OPT_DWR;
    pl->opt[r] &= (unsigned)rnd(s) | (unsigned)rnd(s); /* the outputs: given three times in four */
  }
  pl->timeout = W > 1 ? (double)PICK(s, 0, 3) : (double)PICK(s, 0, 1);
  pl->d_loss_null = pct(s, 30);
  pl->same_ws = pct(s, 40);
  pl->ref_threads = (int)PICK(s, 1, 1, 2);
  pl->ref_gate_up = pct(s, 50) ? MOK_GATE_UP_RECOMPUTE : MOK_GATE_UP_SAVE;
  pl->ref_saved_use = pct(s, 50) ? MOK_SAVED_REUSE : MOK_SAVED_KEEP;
  pl->data_seed = rnd(s);
}

static void describe_plan(fz_log_t* L, const fz_world_t* wd, const char* what) {
  const fz_plan_t* pl = &wd->pl;
  char* d = L->desc;
  const size_t n = sizeof L->desc;
  int at = snprintf(d, n, "%s; W = %d; per rank n, cfg.T, capacity, threads:", what, pl->W);
  for (int r = 0; r < pl->W; r++)
    at += snprintf(d + at, n - (size_t)at, " [%lld %lld %lld %d]", (long long)pl->n[r], (long long)pl->T[r],
                   (long long)wd->capacity[r], pl->threads[r]);
  at += snprintf(d + at, n - (size_t)at, "; layer ");
  at += describe_cfg(d + at, n - (size_t)at, &pl->layer);
  snprintf(d + at, n - (size_t)at, "; timeout %g, d_losses %s, %s workspace; reference threads %d gate_up %d saved_use %d",
           pl->timeout, pl->d_loss_null ? "NULL" : "given", pl->same_ws ? "one" : "two", pl->ref_threads,
           (int)pl->ref_gate_up, (int)pl->ref_saved_use);
}

static void set_real(const fz_world_t* wd, void* p, int64_t i, double v) {
  if (wd->real == 4) ((float*)p)[i] = (float)v;
  else ((double*)p)[i] = v;
}

/* The global batch and its run on one rank (mok_problem_run, W = 1): the bits every
 * valid step of the world must give. Also the rows each rank's experts receive. */
static int world_reference(fz_log_t* L, fz_world_t* wd) {
  const fz_plan_t* pl = &wd->pl;
  const mok_config_t* c = &pl->layer;
  wd->W = pl->W;
  wd->E = c->E, wd->El = c->E / pl->W, wd->H = c->H, wd->F = c->F, wd->K = c->K, wd->Fs = c->Fs;
  const int exact = c->numerics == MOK_NUMERICS_EXACT;
  wd->act = exact ? 8 : 2;
  wd->real = exact ? 8 : 4;
  wd->accum = c->wgrad == MOK_WGRAD_FP32_ACCUM;
  wd->wg = exact ? 8 : wd->accum ? 4 : 2;
  wd->fused = c->routing == MOK_ROUTING_FUSED;
  wd->losses = wd->fused && (c->aux_loss_coef != 0 || c->z_loss_coef != 0);
  wd->T_global = 0;
  wd->aligned = 1;
  for (int r = 0; r < pl->W; r++) {
    wd->rk[r].r = r;
    wd->rk[r].n = pl->n[r];
    wd->rk[r].t0 = wd->T_global;
    wd->rk[r].e0 = r * wd->El;
    wd->T_global += pl->n[r];
    if (r < pl->W - 1 && pl->n[r] % MOK_REDUCE_CHUNK_TOKENS) wd->aligned = 0;
  }
  mok_config_t pc = *c;
  pc.gate_up = pl->ref_gate_up;
  pc.saved_use = pl->ref_saved_use;
  if (mok_problem_create(&pc, wd->T_global, pl->data_seed, &wd->p)) {
    fz_fail(L, "reference run", "mok_problem_create failed");
    return 1;
  }
  if (pl->d_loss_null) set_real(wd, wd->p->d_aux_loss, 0, 1.0), set_real(wd, wd->p->d_z_loss, 0, 1.0);
  mok_run_opts_t o = MOK_RUN_OPTS_INIT;
  o.W = 1;
  o.backward = 1;
  o.num_threads = pl->ref_threads;
  char err[512] = "";
  mok_status_t s = mok_problem_run(wd->p, &o, err, sizeof err);
  if (s) {
    fz_fail(L, "reference run", "the W = 1 run: %s: %s", sname(s), err);
    return 1;
  }
  const int32_t* idx = wd->fused ? wd->p->out_topk_idx : wd->p->topk_idx;
  for (int64_t i = 0; i < wd->T_global * wd->K; i++) wd->rows_to[idx[i] / wd->El]++;
  return 0;
}

/* Creates the W contexts (one thread each) with the plan's per-rank config. */
static int world_create(fz_log_t* L, fz_world_t* wd, uint64_t* s) {
  const fz_plan_t* pl = &wd->pl;
  const int W = pl->W;
  int64_t T_all[kMaxW] = {0};
  for (int r = 0; r < W; r++) T_all[r] = pl->T[r];
  const int64_t most = capacity_max(&pl->layer, T_all);
  if (W > 1 && mok_cpu_comm_create(W, &wd->comm)) abort();
  fz_create_t cs[kMaxW];
  int comm_ranks[kMaxW] = {0};
  memset(cs, 0, sizeof cs);
  for (int r = 0; r < W; r++) {
    mok_config_t* c = &wd->rk[r].c.cfg;
    *c = pl->layer;
    c->T = pl->T[r];
    c->rank = r;
    c->cpu_comm = wd->comm;
    c->num_threads = pl->threads[r];
    c->comm_timeout_s = pl->timeout;
    const int64_t need = wd->rows_to[r] < most ? wd->rows_to[r] : most;
    c->capacity = pl->cap_mode[r] == 0 ? 0 : pl->cap_mode[r] == 1 ? rnd_in(s, need, most) : rnd_in(s, 0, most);
    wd->capacity[r] = c->capacity ? c->capacity : most;
    cs[r].cfg = *c;
    comm_ranks[r] = W > 1 ? W : 0;
  }
  fz_want_t w[kMaxW];
  want_create(cs, W, comm_ranks, w);
  for (int r = 0; r < W; r++)
    if (w[r].n) {
      fz_fail(L, "the test's plan", "rank %d's config breaks %s", r, w[r].r[0].what);
      return 1;
    }
  on_ranks(W, op_create, wd->rk, sizeof wd->rk[0]);
  int bad = 0;
  for (int r = 0; r < W; r++) {
    fz_rank_t* k = &wd->rk[r];
    bad += check_status(L, "mok_context_create", r, &w[r], k->c.status, k->c.msg);
    if (k->c.status) k->c.ctx = NULL;
  }
  if (bad) return 1;
  for (int r = 0; r < W; r++) {
    fz_rank_t* k = &wd->rk[r];
    if (mok_workspace_size(k->c.ctx, &k->ws_bytes) || mok_saved_size(k->c.ctx, &k->sv_bytes) ||
        k->ws_bytes > ((size_t)1 << 30) || k->sv_bytes > ((size_t)1 << 30)) {
      fz_fail(L, "sizes of a created context", "rank %d: workspace %zu, saved %zu bytes", r, k->ws_bytes,
              k->sv_bytes);
      return 1;
    }
  }
  return 0;
}

/* An initial fp32 (or double) accumulator value: small, the same on every rank. */
static double accum_start(int64_t i) { return (double)((int64_t)(((uint64_t)i * 2654435761u) >> 7) % 17 - 8) * 0.125; }

/* Allocates a rank's buffers, copies its slice of the global inputs, poisons the
 * outputs, and builds the valid arguments of its calls. */
static void world_buffers(fz_world_t* wd, fz_rank_t* k) {
  const mok_problem_t* p = wd->p;
  const int64_t n = k->n, H = wd->H, F = wd->F, E = wd->E, El = wd->El, K = wd->K, Fs = wd->Fs;
  const size_t a = wd->act, re = wd->real, g = wd->wg;
  const int ak = a == 2 ? 0 : 2, rk = re == 4 ? 1 : 2, gk = g == 2 ? 0 : g == 4 ? 1 : 2;
  fz_buf_t* b = k->b;
  struct {
    int id;
    size_t bytes;
    int kind;
    size_t elem;
    const void* from; /* input: copied from here */
  } spec[] = {
      {B_X, (size_t)(n * H) * a, ak, a, (const char*)p->x + k->t0 * H * a},
      {B_WR, (size_t)(E * H) * a, ak, a, p->w_router},
      {B_BIAS, (size_t)E * re, rk, re, p->bias_select},
      {B_BR, (size_t)E * re, rk, re, p->b_router},
      {B_W13, (size_t)(El * 2 * F * H) * a, ak, a, (const char*)p->w13 + k->e0 * 2 * F * H * a},
      {B_W2, (size_t)(El * H * F) * a, ak, a, (const char*)p->w2 + k->e0 * H * F * a},
      {B_B13, (size_t)(El * 2 * F) * a, ak, a, (const char*)p->b13 + k->e0 * 2 * F * a},
      {B_B2, (size_t)(El * H) * a, ak, a, (const char*)p->b2 + k->e0 * H * a},
      {B_WS13, (size_t)(2 * Fs * H) * a, ak, a, p->ws13},
      {B_WS2, (size_t)(H * Fs) * a, ak, a, p->ws2},
      {B_WSG, (size_t)H * a, ak, a, p->w_sg},
      {B_DY, (size_t)(n * H) * a, ak, a, (const char*)p->dy + k->t0 * H * a},
      {B_DAUX, re, rk, re, p->d_aux_loss},
      {B_DZ, re, rk, re, p->d_z_loss},
      {B_IDX, (size_t)(n * K) * 4, 3, 4, wd->fused ? NULL : (const char*)p->topk_idx + k->t0 * K * 4},
      {B_TW, (size_t)(n * K) * re, rk, re, wd->fused ? NULL : (const char*)p->topk_weight + k->t0 * K * re},
      {B_Y, (size_t)(n * H) * a, ak, a, NULL},
      {B_TPE, (size_t)E * 4, 3, 4, NULL},
      {B_AUX, re, rk, re, NULL},
      {B_Z, re, rk, re, NULL},
      {B_SAVED, k->sv_bytes, 3, 4, NULL},
      {B_SAVED2, k->sv_bytes, 3, 4, NULL},
      {B_DX, (size_t)(n * H) * a, ak, a, NULL},
      {B_DTW, (size_t)(n * K) * re, rk, re, NULL},
      {B_DWR, (size_t)(E * H) * g, gk, g, NULL},
      {B_DBR, (size_t)E * re, rk, re, NULL}, /* (fp32 whatever cfg.wgrad: re is g where it accumulates) */
      {B_DW13, (size_t)(El * 2 * F * H) * g, gk, g, NULL},
      {B_DW2, (size_t)(El * H * F) * g, gk, g, NULL},
      {B_DB13, (size_t)(El * 2 * F) * g, gk, g, NULL},
      {B_DB2, (size_t)(El * H) * g, gk, g, NULL},
      {B_DWSG, (size_t)H * g, gk, g, NULL},
      {B_DWS13, (size_t)(2 * Fs * H) * g, gk, g, NULL},
      {B_DWS2, (size_t)(H * Fs) * g, gk, g, NULL},
      {B_WS, k->ws_bytes, 3, 4, NULL},
      {B_WS_BWD, k->ws_bytes, 3, 4, NULL},
  };
  for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++) {
    fz_buf_t* x = &b[spec[i].id];
    buf_alloc(x, spec[i].bytes, spec[i].kind, spec[i].elem);
    if (spec[i].from && spec[i].bytes) memcpy(x->p, spec[i].from, spec[i].bytes);
  }
  if (wd->accum) /* fp32 accumulators start from values of their own, the same on every rank */
    for (int id = B_DWR; id <= B_DWS2; id++)
      for (int64_t i = 0; i < (int64_t)(b[id].bytes / g); i++) set_real(wd, b[id].p, i, accum_start(i));
  const unsigned o = wd->pl.opt[k->r];
  const mok_config_t* c = &wd->pl.layer;
  const int tok = n > 0, shared = Fs > 0;
#define GIVE(cond, id) ((cond) ? (void*)b[id].p : NULL)
  mok_forward_args_t* fa = &k->fa;
  memset(fa, 0, sizeof *fa);
  fa->num_tokens = n;
  fa->x = GIVE(tok || (o & OPT_X0), B_X);
  fa->w_router = GIVE(wd->fused || (o & OPT_WR), B_WR);
  fa->bias_select = GIVE((wd->fused && c->use_bias_select) || (o & OPT_BIAS), B_BIAS);
  fa->b_router = GIVE((wd->fused && c->use_router_bias) || (o & OPT_VAR_IN), B_BR);
  fa->w13 = b[B_W13].p;
  fa->w2 = b[B_W2].p;
  fa->b13 = GIVE(c->use_expert_bias || (o & OPT_VAR_IN), B_B13);
  fa->b2 = GIVE(c->use_expert_bias || (o & OPT_VAR_IN), B_B2);
  fa->ws13 = GIVE(shared || (o & OPT_SHARED), B_WS13);
  fa->ws2 = GIVE(shared || (o & OPT_SHARED), B_WS2);
  fa->w_sg = GIVE(c->use_shared_gate || (o & OPT_VAR_IN), B_WSG);
  fa->topk_idx = GIVE(wd->fused ? (o & OPT_IDX) : tok || (o & OPT_IDX0), B_IDX);
  fa->topk_weight = GIVE(wd->fused ? (o & OPT_IDX) : tok || (o & OPT_IDX0), B_TW);
  fa->y = GIVE(tok || (o & OPT_Y0), B_Y);
  fa->tokens_per_expert = GIVE(o & OPT_TPE, B_TPE);
  fa->aux_loss = GIVE(o & OPT_AUX, B_AUX);
  fa->z_loss = GIVE(o & OPT_Z, B_Z);
  fa->saved = b[B_SAVED].p;
  fa->saved_bytes = k->sv_bytes + (size_t)((o >> 16) % 3 == 0 ? (o >> 20) % 64 : 0); /* (more is valid) */
  fa->workspace = b[B_WS].p;
  fa->workspace_bytes = k->ws_bytes + (size_t)((o >> 24) % 3 == 0 ? (o >> 26) % 64 : 0);
  mok_backward_args_t* ba = &k->ba;
  memset(ba, 0, sizeof *ba);
  ba->num_tokens = n;
  ba->x = GIVE(tok || (o & OPT_X0), B_X);
  ba->w_router = GIVE(wd->fused || (o & OPT_WR), B_WR);
  ba->w13 = b[B_W13].p;
  ba->w2 = b[B_W2].p;
  ba->b13 = fa->b13;
  ba->ws13 = GIVE(shared || (o & OPT_SHARED), B_WS13);
  ba->ws2 = GIVE(shared || (o & OPT_SHARED), B_WS2);
  ba->w_sg = fa->w_sg;
  ba->dy = GIVE(tok || (o & OPT_DY0), B_DY);
  ba->d_aux_loss = wd->pl.d_loss_null ? NULL : (const float*)b[B_DAUX].p;
  ba->d_z_loss = wd->pl.d_loss_null ? NULL : (const float*)b[B_DZ].p;
  ba->saved = b[B_SAVED].p;
  ba->saved_bytes = fa->saved_bytes;
  ba->dx = GIVE(tok || (o & OPT_DX0), B_DX);
  ba->d_topk_weight = GIVE(!wd->fused && (tok || (o & OPT_DTW0)), B_DTW);
  ba->d_w_router = GIVE(wd->fused && (o & OPT_DWR), B_DWR); /* (replay: no router gradient) */
  ba->d_b_router = GIVE(o & OPT_DBR, B_DBR);
  ba->d_w13 = b[B_DW13].p;
  ba->d_w2 = b[B_DW2].p;
  ba->d_b13 = GIVE(c->use_expert_bias || (o & OPT_VAR_IN), B_DB13);
  ba->d_b2 = GIVE(c->use_expert_bias || (o & OPT_VAR_IN), B_DB2);
  ba->d_ws13 = GIVE(shared || (o & OPT_SHARED), B_DWS13);
  ba->d_ws2 = GIVE(shared || (o & OPT_SHARED), B_DWS2);
  ba->d_w_sg = GIVE(c->use_shared_gate || (o & OPT_VAR_IN), B_DWSG);
  ba->workspace = b[wd->pl.same_ws ? B_WS : B_WS_BWD].p;
  ba->workspace_bytes = fa->workspace_bytes;
#undef GIVE
  k->saved[0] = k->saved[1] = (fz_saved_t){SAVED_BAD, 0, 0};
}

/* ---- what a forward and a backward of a rank must give: api.c's rules ---- */

enum { REQ_NONE, REQ_ALWAYS, REQ_TOK, REQ_FUSED, REQ_BIAS, REQ_SHARED, REQ_REPLAY_TOK, REQ_ROUTER_BIAS, REQ_EXPERT_BIAS, REQ_SHARED_GATE };
typedef struct {
  const char* name;
  size_t off;   /* in the arguments */
  int buf;
  int req;
  size_t align; /* 0: the weight-gradient rule (4 in fp32, else 16) */
} fz_field_t;

#define FF(nm, b, req, al) {#nm, offsetof(mok_forward_args_t, nm), b, req, al}
static const fz_field_t kFwdFields[] = {
    FF(x, B_X, REQ_TOK, 16), FF(w_router, B_WR, REQ_FUSED, 16), FF(bias_select, B_BIAS, REQ_BIAS, 16),
    FF(b_router, B_BR, REQ_ROUTER_BIAS, 16),
    FF(w13, B_W13, REQ_ALWAYS, 16), FF(w2, B_W2, REQ_ALWAYS, 16), FF(b13, B_B13, REQ_EXPERT_BIAS, 16),
    FF(b2, B_B2, REQ_EXPERT_BIAS, 16), FF(ws13, B_WS13, REQ_SHARED, 16), FF(w_sg, B_WSG, REQ_SHARED_GATE, 16),
    FF(ws2, B_WS2, REQ_SHARED, 16), FF(topk_idx, B_IDX, REQ_REPLAY_TOK, 16),
    FF(topk_weight, B_TW, REQ_REPLAY_TOK, 16), FF(y, B_Y, REQ_TOK, 16),
    FF(tokens_per_expert, B_TPE, REQ_NONE, 4), FF(aux_loss, B_AUX, REQ_NONE, 4), FF(z_loss, B_Z, REQ_NONE, 4),
    FF(saved, B_SAVED, REQ_ALWAYS, 256), FF(workspace, B_WS, REQ_ALWAYS, 256)};
#undef FF
#define BF(nm, b, req, al) {#nm, offsetof(mok_backward_args_t, nm), b, req, al}
static const fz_field_t kBwdFields[] = {
    BF(x, B_X, REQ_TOK, 16), BF(w_router, B_WR, REQ_FUSED, 16), BF(w13, B_W13, REQ_ALWAYS, 16),
    BF(w2, B_W2, REQ_ALWAYS, 16), BF(b13, B_B13, REQ_EXPERT_BIAS, 16), BF(ws13, B_WS13, REQ_SHARED, 16),
    BF(ws2, B_WS2, REQ_SHARED, 16), BF(w_sg, B_WSG, REQ_SHARED_GATE, 16),
    BF(dy, B_DY, REQ_TOK, 16), BF(d_aux_loss, B_DAUX, REQ_NONE, 4), BF(d_z_loss, B_DZ, REQ_NONE, 4),
    BF(saved, B_SAVED, REQ_ALWAYS, 256), BF(dx, B_DX, REQ_TOK, 16), BF(d_topk_weight, B_DTW, REQ_REPLAY_TOK, 16),
    BF(d_w_router, B_DWR, REQ_NONE, 0), BF(d_b_router, B_DBR, REQ_NONE, 0), BF(d_w13, B_DW13, REQ_ALWAYS, 0), BF(d_w2, B_DW2, REQ_ALWAYS, 0),
    BF(d_b13, B_DB13, REQ_EXPERT_BIAS, 0), BF(d_b2, B_DB2, REQ_EXPERT_BIAS, 0), BF(d_w_sg, B_DWSG, REQ_SHARED_GATE, 0),
    BF(d_ws13, B_DWS13, REQ_SHARED, 0), BF(d_ws2, B_DWS2, REQ_SHARED, 0), BF(workspace, B_WS_BWD, REQ_ALWAYS, 256)};
#undef BF
enum { kNumFwdFields = sizeof kFwdFields / sizeof kFwdFields[0], kNumBwdFields = sizeof kBwdFields / sizeof kBwdFields[0] };

static const void* field_get(const void* args, size_t off) {
  const void* v;
  memcpy(&v, (const char*)args + off, sizeof v);
  return v;
}
static void field_set(void* args, size_t off, const void* v) { memcpy((char*)args + off, &v, sizeof v); }

static int required(int req, const mok_config_t* c, int64_t T) {
  const int tok = T > 0, fused = c->routing == MOK_ROUTING_FUSED;
  switch (req) {
    case REQ_ALWAYS: return 1;
    case REQ_TOK: return tok;
    case REQ_FUSED: return fused;
    case REQ_BIAS: return fused && c->use_bias_select;
    case REQ_SHARED: return c->Fs > 0;
    case REQ_REPLAY_TOK: return !fused && tok;
    case REQ_ROUTER_BIAS: return fused && c->use_router_bias;
    case REQ_EXPERT_BIAS: return c->use_expert_bias;
    case REQ_SHARED_GATE: return c->use_shared_gate;
    default: return 0;
  }
}

/* The pointer rules of a call: NULL where required, or off its alignment. */
static void want_pointers(const fz_field_t* fields, int num, const void* args, const mok_config_t* c, int64_t T,
                          fz_want_t* w) {
  static char names[2][32][40];
  const int which = fields == kBwdFields;
  for (int i = 0; i < num; i++) {
    const fz_field_t* f = &fields[i];
    const void* v = field_get(args, f->off);
    const size_t align = f->align ? f->align : c->wgrad == MOK_WGRAD_FP32_ACCUM ? 4 : 16;
    snprintf(names[which][i], sizeof names[which][i], "args->%s", f->name);
    if (!v && required(f->req, c, T)) want(w, names[which][i], MOK_STATUS_NULL_POINTER, names[which][i]);
    else if (v && (uintptr_t)v % align) want(w, names[which][i], MOK_STATUS_MISALIGNED_POINTER, names[which][i]);
  }
}

/* The rank's own rules of its forward (before any barrier): *empty when it is the
 * empty-batch call of W = 1. */
static void want_forward_local(const fz_rank_t* k, fz_want_t* w, int* empty) {
  memset(w, 0, sizeof *w);
  *empty = 0;
  if (!k->call_ctx || k->no_args) {
    if (!k->call_ctx) want(w, "ctx NULL", MOK_STATUS_INVALID_CONTEXT, NULL);
    else want(w, "args NULL", MOK_STATUS_NULL_POINTER, "args");
    return;
  }
  const mok_config_t* c = &k->c.cfg;
  const mok_forward_args_t* a = &k->fcall;
  const int64_t T = a->num_tokens, K = c->K, E = c->E;
  const int T_ok = T >= 0 && T <= c->T;
  if (!T_ok) want(w, "args->num_tokens outside [0, cfg.T]", MOK_STATUS_INVALID_SHAPE, "args->num_tokens");
  want_pointers(kFwdFields, kNumFwdFields, a, c, T, w);
  if (a->workspace_bytes < k->ws_bytes)
    want(w, "args->workspace_bytes", MOK_STATUS_WORKSPACE_TOO_SMALL, "args->workspace_bytes");
  if (a->saved_bytes < k->sv_bytes) want(w, "args->saved_bytes", MOK_STATUS_WORKSPACE_TOO_SMALL, "args->saved_bytes");
  if (w->n) return;
  if (T == 0 && c->W == 1) {
    *empty = 1;
    return;
  }
  if (c->routing == MOK_ROUTING_REPLAY) /* K distinct experts in [0, E) per token */
    for (int64_t t = 0; t < T && t < k->n; t++)
      for (int64_t j = 0; j < K; j++) {
        const int32_t e = a->topk_idx[t * K + j];
        if (e < 0 || e >= E) {
          want(w, "args->topk_idx outside [0, E)", MOK_STATUS_INDEX_OUT_OF_RANGE, "args->topk_idx");
          continue;
        }
        for (int64_t i = 0; i < j; i++)
          if (a->topk_idx[t * K + i] == e) {
            want(w, "args->topk_idx twice in a token", MOK_STATUS_DUPLICATE_INDEX, "args->topk_idx");
            break;
          }
      }
}

/* The rank's own rules of its backward; *saved_bad: its saved fails the check (one
 * verdict for all ranks), *saved_maybe: may fail it. */
static void want_backward_local(const fz_rank_t* k, fz_want_t* w, int* empty, int* saved_bad, int* saved_maybe) {
  memset(w, 0, sizeof *w);
  *empty = *saved_bad = *saved_maybe = 0;
  if (!k->call_ctx || k->no_args) {
    if (!k->call_ctx) want(w, "ctx NULL", MOK_STATUS_INVALID_CONTEXT, NULL);
    else want(w, "args NULL", MOK_STATUS_NULL_POINTER, "args");
    return;
  }
  const mok_config_t* c = &k->c.cfg;
  const mok_backward_args_t* a = &k->bcall;
  const int64_t T = a->num_tokens;
  if (T < 0 || T > c->T) want(w, "args->num_tokens outside [0, cfg.T]", MOK_STATUS_INVALID_SHAPE, "args->num_tokens");
  want_pointers(kBwdFields, kNumBwdFields, a, c, T, w);
  if (a->workspace_bytes < k->ws_bytes)
    want(w, "args->workspace_bytes", MOK_STATUS_WORKSPACE_TOO_SMALL, "args->workspace_bytes");
  if (a->saved_bytes < k->sv_bytes) want(w, "args->saved_bytes", MOK_STATUS_WORKSPACE_TOO_SMALL, "args->saved_bytes");
  if (w->n) return;
  if (T == 0 && c->W == 1) {
    *empty = 1;
    return;
  }
  const fz_saved_t* sv = a->saved == k->b[B_SAVED].p ? &k->saved[0] : a->saved == k->b[B_SAVED2].p ? &k->saved[1] : NULL;
  if (!sv || sv->state == SAVED_BAD || sv->used || sv->n != T) *saved_bad = 1;
  else if (sv->state == SAVED_EITHER) *saved_maybe = 1;
}

/* Combines the ranks' own verdicts into each rank's outcome (k->w): all fail, each its
 * own; some fail, the others wait for them and time out; none, the step's: capacity
 * (forward), the one saved verdict (backward), else success. */
static void world_want(fz_world_t* wd, int backward) {
  const int W = wd->W;
  int failing = 0, saved_bad = 0, saved_maybe = 0;
  for (int r = 0; r < W; r++) {
    fz_rank_t* k = &wd->rk[r];
    int bad = 0, maybe = 0;
    if (backward) want_backward_local(k, &k->w, &k->empty, &bad, &maybe);
    else want_forward_local(k, &k->w, &k->empty);
    failing += k->w.n > 0;
    saved_bad |= bad;
    saved_maybe |= maybe;
  }
  if (failing == W) return;
  for (int r = 0; r < W; r++) {
    fz_rank_t* k = &wd->rk[r];
    if (failing) {
      if (!k->w.n) want(&k->w, "a peer failed its checks: time out", MOK_STATUS_COMM_TIMEOUT, "comm_timeout_s|arrive");
      continue;
    }
    if (k->empty) continue;
    if (!backward) {
      for (int o = 0; o < W; o++)
        if (wd->rows_to[o] > wd->capacity[o]) {
          want(&k->w, "a rank's rows above its capacity", MOK_STATUS_CAPACITY_EXCEEDED, "capacity");
          break;
        }
    } else if (saved_bad) {
      want(&k->w, "saved refused", MOK_STATUS_INVALID_SAVED, "saved");
    } else if (saved_maybe) {
      want(&k->w, "saved altered where unchecked", MOK_STATUS_INVALID_SAVED, "saved");
      k->w.may_succeed = 1;
    }
  }
}

/* ---- running a call on every rank and checking what it left ---- */

static void op_forward(void* p) {
  fz_rank_t* k = p;
  k->c.status = mok_forward(k->call_ctx, k->no_args ? NULL : &k->fcall);
  snprintf(k->c.msg, sizeof k->c.msg, "%s", mok_context_last_error(k->call_ctx));
}

static void op_backward(void* p) {
  fz_rank_t* k = p;
  k->c.status = mok_backward(k->call_ctx, k->no_args ? NULL : &k->bcall);
  snprintf(k->c.msg, sizeof k->c.msg, "%s", mok_context_last_error(k->call_ctx));
}

static int is_finite(const fz_buf_t* b, const void* base, int64_t i) {
  switch (b->kind) {
    case 0: return (((const uint16_t*)base)[i] & 0x7f80) != 0x7f80;
    case 1: return isfinite(((const float*)base)[i]);
    case 2: return isfinite(((const double*)base)[i]);
    default: return 1;
  }
}

static double value_at(const fz_buf_t* b, const void* base, int64_t i) {
  mok_tensor_view_t v = {"", base, (int64_t)(b->bytes / b->elem), b->elem, b->kind};
  return mok_view_get(&v, i);
}

/* What a call may leave in a buffer: as it was, the reference's bits, finite values,
 * or anything (saved when a forward writes it; the workspaces). */
typedef enum { LEAVE, SAME_AS, FINITE, ANY } fz_mode_t;

static int check_buffer(fz_log_t* L, const char* call, const fz_rank_t* k, int id, fz_mode_t mode,
                        const void* want_bytes) {
  const fz_buf_t* b = &k->b[id];
  const size_t total = rounded(b->bytes);
  if (memcmp(b->p + b->bytes, b->before + b->bytes, total - b->bytes) != 0) {
    fz_fail(L, "wrote past a buffer", "%s, rank %d: wrote past the end of %s (%zu bytes)", call, k->r, kBufName[id],
            b->bytes);
    return 1;
  }
  const int64_t count = (int64_t)(b->bytes / b->elem);
  if (mode == LEAVE || mode == SAME_AS) {
    const unsigned char* want = mode == LEAVE ? b->before : want_bytes;
    if (memcmp(b->p, want, b->bytes) != 0) {
      int64_t i = 0;
      while (i < count && memcmp(b->p + i * b->elem, want + i * b->elem, b->elem) == 0) i++;
      if (mode == LEAVE)
        fz_fail(L, "changed a buffer it may not write", "%s, rank %d: %s[%lld] changed: %.9g, before %.9g", call,
                k->r, kBufName[id], (long long)i, value_at(b, b->p, i), value_at(b, want, i));
      else
        fz_fail(L, "D3: not the bits of W = 1", "%s, rank %d: %s[%lld] = %.9g, the W = 1 run's %.9g (of %lld)",
                call, k->r, kBufName[id], (long long)i, value_at(b, b->p, i), value_at(b, want, i),
                (long long)count);
      return 1;
    }
  }
  if (mode == SAME_AS || mode == FINITE)
    for (int64_t i = 0; i < count; i++)
      if (!is_finite(b, b->p, i)) {
        fz_fail(L, "an output is not finite", "%s, rank %d: %s[%lld] = %.9g", call, k->r, kBufName[id],
                (long long)i, value_at(b, b->p, i));
        return 1;
      }
  return 0;
}

/* The W = 1 run's bits of a rank's output buffer (NULL for none), and for fp32
 * accumulators before + those (into tmp). */
static const void* reference_of(const fz_world_t* wd, const fz_rank_t* k, int id, void* tmp) {
  const mok_problem_t* p = wd->p;
  const int64_t H = wd->H, F = wd->F, K = wd->K;
  const size_t a = wd->act, re = wd->real, g = wd->wg;
  const void* ref = NULL;
  switch (id) {
    case B_Y: ref = (const char*)p->y + k->t0 * H * a; break;
    case B_IDX: ref = (const char*)p->out_topk_idx + k->t0 * K * 4; break;
    case B_TW: ref = (const char*)p->out_topk_weight + k->t0 * K * re; break;
    case B_TPE: ref = p->tokens_per_expert; break;
    case B_AUX: ref = p->aux_loss; break;
    case B_Z: ref = p->z_loss; break;
    case B_DX: ref = (const char*)p->dx + k->t0 * H * a; break;
    case B_DTW: ref = (const char*)p->d_topk_weight + k->t0 * K * re; break;
    case B_DWR: ref = p->d_w_router; break;
    case B_DBR: ref = p->d_b_router; break;
    case B_DW13: ref = (const char*)p->d_w13 + k->e0 * 2 * F * H * g; break;
    case B_DW2: ref = (const char*)p->d_w2 + k->e0 * H * F * g; break;
    case B_DB13: ref = (const char*)p->d_b13 + k->e0 * 2 * F * g; break;
    case B_DB2: ref = (const char*)p->d_b2 + k->e0 * H * g; break;
    case B_DWS13: ref = p->d_ws13; break;
    case B_DWS2: ref = p->d_ws2; break;
    case B_DWSG: ref = p->d_w_sg; break;
    default: return NULL;
  }
  if (!wd->accum || id < B_DWR || id > B_DWS2) return ref;
  const fz_buf_t* b = &k->b[id];
  for (size_t i = 0; i < b->bytes / g; i++) {
    if (g == 4) ((float*)tmp)[i] = ((const float*)b->before)[i] + ((const float*)ref)[i];
    else ((double*)tmp)[i] = ((const double*)b->before)[i] + ((const double*)ref)[i];
  }
  return tmp;
}

static void snapshot(fz_world_t* wd) {
  for (int r = 0; r < wd->W; r++)
    for (int i = 0; i < B_NUM; i++) {
      fz_buf_t* b = &wd->rk[r].b[i];
      memcpy(b->before, b->p, rounded(b->bytes));
    }
}

/* After a call: each rank's status and message, then its buffers: a failed call leaves
 * every one as it was; a successful one writes its outputs (those given) with the
 * reference's bits, or finite where only that is known, and nothing else. */
static int world_check(fz_log_t* L, fz_world_t* wd, const char* call, int backward) {
  int bad = 0;
  for (int r = 0; r < wd->W; r++) {
    fz_rank_t* k = &wd->rk[r];
    bad += check_status(L, call, r, &k->w, k->c.status, k->c.msg);
    const int ok = k->c.status == MOK_STATUS_SUCCESS && !k->no_args && k->call_ctx;
    const int replicated_exact = wd->W == 1 || wd->aligned;
    for (int id = 0; id < B_NUM; id++) {
      fz_mode_t mode = LEAVE;
      const void* given = NULL;
      int zero = 0; /* the empty batch's zeros, not the reference's slice */
      if (id == B_WS || id == B_WS_BWD) {
        mode = ANY;
      } else if (ok && !backward && k->empty) { /* zero counts and losses (those given), nothing else */
        const mok_forward_args_t* a = &k->fcall;
        given = id == B_TPE ? (const void*)a->tokens_per_expert : id == B_AUX ? (const void*)a->aux_loss
                : id == B_Z ? (const void*)a->z_loss : NULL;
        if (given && given == k->b[id].p) mode = SAME_AS, zero = 1;
      } else if (ok && !backward) {
        const mok_forward_args_t* a = &k->fcall;
        switch (id) {
          case B_Y: given = a->y; break;
          case B_IDX: given = wd->fused ? (const void*)a->topk_idx : NULL; break;
          case B_TW: given = wd->fused ? (const void*)a->topk_weight : NULL; break;
          case B_TPE: given = a->tokens_per_expert; break;
          case B_AUX: given = a->aux_loss; break;
          case B_Z: given = a->z_loss; break;
          case B_SAVED: case B_SAVED2: if (a->saved == k->b[id].p) mode = ANY; break;
          default: break;
        }
        if (given == k->b[id].p)
          mode = (id == B_AUX || id == B_Z) && wd->losses && !replicated_exact ? FINITE : SAME_AS;
      } else if (ok && k->empty) { /* bf16 weight gradients zero, fp32 ones as they were; saved not read */
        const mok_backward_args_t* a = &k->bcall;
        switch (id) {
          case B_DWR: given = wd->fused ? a->d_w_router : NULL; break;
          case B_DBR: given = wd->fused && k->c.cfg.use_router_bias ? a->d_b_router : NULL; break;
          case B_DW13: given = a->d_w13; break;
          case B_DW2: given = a->d_w2; break;
          case B_DB13: given = k->c.cfg.use_expert_bias ? a->d_b13 : NULL; break;
          case B_DB2: given = k->c.cfg.use_expert_bias ? a->d_b2 : NULL; break;
          case B_DWS13: given = wd->Fs ? a->d_ws13 : NULL; break;
          case B_DWS2: given = wd->Fs ? a->d_ws2 : NULL; break;
          case B_DWSG: given = k->c.cfg.use_shared_gate ? a->d_w_sg : NULL; break;
          default: break;
        }
        if (given && given == k->b[id].p && !wd->accum) mode = SAME_AS, zero = 1;
      } else if (ok) {
        const mok_backward_args_t* a = &k->bcall;
        switch (id) {
          case B_DX: given = a->dx; break;
          case B_DTW: given = a->d_topk_weight; break;
          case B_DWR: given = wd->fused ? a->d_w_router : NULL; break;
          case B_DBR: given = wd->fused && k->c.cfg.use_router_bias ? a->d_b_router : NULL; break;
          case B_DW13: given = a->d_w13; break;
          case B_DW2: given = a->d_w2; break;
          case B_DB13: given = k->c.cfg.use_expert_bias ? a->d_b13 : NULL; break;
          case B_DB2: given = k->c.cfg.use_expert_bias ? a->d_b2 : NULL; break;
          case B_DWS13: given = wd->Fs ? a->d_ws13 : NULL; break;
          case B_DWS2: given = wd->Fs ? a->d_ws2 : NULL; break;
          case B_DWSG: given = k->c.cfg.use_shared_gate ? a->d_w_sg : NULL; break;
          case B_SAVED: case B_SAVED2:
            if (a->saved == k->b[id].p && k->c.cfg.saved_use == MOK_SAVED_REUSE) mode = ANY;
            break;
          default: break;
        }
        if (given == k->b[id].p) {
          const int replicated = id == B_DWR || id == B_DBR || id == B_DWS13 || id == B_DWS2 || id == B_DWSG;
          mode = wd->values_differ == 2 ? ANY : wd->values_differ || (replicated && !replicated_exact) ? FINITE : SAME_AS;
        }
      }
      void* tmp = NULL;
      const void* ref = NULL;
      if (mode == SAME_AS) {
        tmp = calloc(1, k->b[id].bytes + 1);
        if (!tmp) abort();
        ref = zero ? tmp : reference_of(wd, k, id, tmp);
      }
      bad += check_buffer(L, call, k, id, mode, ref);
      free(tmp);
    }
  }
  /* the replicated outputs are one value on every rank */
  static const int replicated[] = {B_TPE, B_AUX, B_Z, B_DWR, B_DBR, B_DWS13, B_DWS2, B_DWSG};
  for (int i = 0; i < (int)(sizeof replicated / sizeof replicated[0]); i++)
    for (int r = 1; r < wd->W; r++) {
      const fz_rank_t *k0 = &wd->rk[0], *k = &wd->rk[r];
      const fz_buf_t *b0 = &k0->b[replicated[i]], *b = &k->b[replicated[i]];
      if (k0->c.status || k->c.status || memcmp(b0->before, b->before, b->bytes) != 0) continue;
      if (memcmp(b0->p, b->p, b->bytes) != 0 && memcmp(b->p, b->before, b->bytes) != 0 &&
          memcmp(b0->p, b0->before, b0->bytes) != 0) {
        fz_fail(L, "replicated outputs differ between ranks", "%s: %s of rank %d differs from rank 0's", call,
                kBufName[replicated[i]], r);
        bad++;
      }
    }
  /* what the test knows of saved now */
  for (int r = 0; r < wd->W; r++) {
    fz_rank_t* k = &wd->rk[r];
    if (k->c.status || k->no_args || !k->call_ctx || k->empty) continue;
    for (int i = 0; i < 2; i++) {
      const void* sp = k->b[i ? B_SAVED2 : B_SAVED].p;
      if (!backward && k->fcall.saved == sp) k->saved[i] = (fz_saved_t){SAVED_OK, k->fcall.num_tokens, 0};
      if (backward && k->bcall.saved == sp && k->c.cfg.saved_use == MOK_SAVED_REUSE) k->saved[i].used = 1;
    }
  }
  return bad;
}

/* Runs the ranks' forwards (fcall) at once and checks them. */
static int world_forward(fz_log_t* L, fz_world_t* wd, const char* call) {
  world_want(wd, 0);
  snapshot(wd);
  on_ranks(wd->W, op_forward, wd->rk, sizeof wd->rk[0]);
  return world_check(L, wd, call, 0);
}

static int world_backward(fz_log_t* L, fz_world_t* wd, const char* call) {
  world_want(wd, 1);
  snapshot(wd);
  on_ranks(wd->W, op_backward, wd->rk, sizeof wd->rk[0]);
  return world_check(L, wd, call, 1);
}

static void world_valid_args(fz_world_t* wd) {
  for (int r = 0; r < wd->W; r++) {
    fz_rank_t* k = &wd->rk[r];
    k->fcall = k->fa;
    k->bcall = k->ba;
    k->no_args = 0;
    k->call_ctx = k->c.ctx;
  }
}

/* Poisons every output of the ranks (the fp32 accumulators keep their values). */
static void world_poison(fz_world_t* wd) {
  for (int r = 0; r < wd->W; r++)
    for (int id = B_Y; id <= B_DWS2; id++) {
      if (id == B_SAVED || id == B_SAVED2 || (wd->accum && id >= B_DWR)) continue;
      memset(wd->rk[r].b[id].p, POISON, wd->rk[r].b[id].bytes);
    }
  if (wd->fused)
    for (int r = 0; r < wd->W; r++)
      for (int id = B_IDX; id <= B_TW; id++) memset(wd->rk[r].b[id].p, POISON, wd->rk[r].b[id].bytes);
}

/* Plan, reference, contexts, buffers: a world ready for its calls (0), or failed (1;
 * the contexts that exist are destroyed). */
static int world_setup(fz_log_t* L, fz_world_t* wd, uint64_t* s, const char* what) {
  describe_plan(L, wd, what);
  if (world_reference(L, wd)) return 1;
  if (world_create(L, wd, s)) {
    describe_plan(L, wd, what);
    for (int r = 0; r < wd->W; r++) wd->rk[r].c.status = MOK_STATUS_SUCCESS;
    on_ranks(wd->W, op_destroy, wd->rk, sizeof wd->rk[0]);
    return 1;
  }
  describe_plan(L, wd, what);
  for (int r = 0; r < wd->W; r++) world_buffers(wd, &wd->rk[r]);
  world_valid_args(wd);
  return 0;
}

static int all_succeeded(const fz_world_t* wd) {
  for (int r = 0; r < wd->W; r++)
    if (wd->rk[r].c.status) return 0;
  return 1;
}

/* ---- case: calls ---- */

typedef enum {
  M_TOKENS, M_NULL, M_MISALIGN, M_WS_SIZE, M_SAVED_SIZE, M_NO_ARGS, M_NO_CTX, /* forward and backward */
  M_IDX,                                                                    /* forward, replay routing */
  M_OTHER_TOKENS, M_SAVED_NEVER, M_SAVED_ROTATE,                            /* backward */
  M_NUM
} call_mutation_t;
static const char* const kCallMutation[] = {
    "num_tokens outside [0, cfg.T]", "a pointer NULL", "a pointer misaligned", "workspace_bytes small",
    "saved_bytes small", "args NULL", "ctx NULL", "topk_idx out of range or twice", "num_tokens not the forward's",
    "saved never written", "saved of the next rank"};

static size_t misalign(uint64_t* s, size_t align) {
  size_t o;
  do o = (size_t)PICK(s, 1, 2, 3, 4, 8, 12, 15, 16, 32, 64, 128, 255);
  while (o % align == 0);
  return o;
}

/* A size below need: most often by one byte (the boundary), else by any amount. */
static size_t short_of(uint64_t* s, size_t need) {
  if (need == 0) return 0;
  const size_t by = pct(s, 50) ? 1 : pct(s, 30) ? 256 : (size_t)rnd_in(s, 1, (int64_t)need);
  return by < need ? need - by : 0;
}

/* Breaks one rank's arguments of its next call by m (field f for the pointer ones). */
static void mutate_call(uint64_t* s, fz_world_t* wd, fz_rank_t* k, int backward, call_mutation_t m, int f) {
  void* args = backward ? (void*)&k->bcall : (void*)&k->fcall;
  int64_t* tokens = backward ? &k->bcall.num_tokens : &k->fcall.num_tokens;
  size_t* ws_bytes = backward ? &k->bcall.workspace_bytes : &k->fcall.workspace_bytes;
  size_t* sv_bytes = backward ? &k->bcall.saved_bytes : &k->fcall.saved_bytes;
  const fz_field_t* field = backward ? &kBwdFields[f] : &kFwdFields[f];
  const int64_t T = k->c.cfg.T, K = wd->K, E = wd->E;
  switch (m) {
    case M_TOKENS: *tokens = PICK(s, T + 1, T + rnd_in(s, 2, 1000), INT64_MAX, -1, -rnd_in(s, 2, 1000), INT64_MIN); break;
    case M_NULL: field_set(args, field->off, NULL); break;
    case M_MISALIGN: {
      const void* v = field_get(args, field->off);
      const size_t align = field->align ? field->align : wd->accum ? 4 : 16;
      field_set(args, field->off, (const char*)(v ? v : (const void*)k->b[field->buf].p) + misalign(s, align));
      break;
    }
    case M_WS_SIZE: *ws_bytes = short_of(s, k->ws_bytes); break;
    case M_SAVED_SIZE: *sv_bytes = short_of(s, k->sv_bytes); break;
    case M_NO_ARGS: k->no_args = 1; break;
    case M_NO_CTX: k->call_ctx = NULL; break;
    case M_IDX: /* in place (restored after the call): out of range, or a token's expert twice */
      for (int i = 0, num = (int)rnd_in(s, 1, 3); i < num && k->n > 0; i++) {
        int32_t* idx = (int32_t*)k->b[B_IDX].p;
        const int64_t t = rnd_in(s, 0, k->n - 1), j = rnd_in(s, 0, K - 1);
        if (K > 1 && pct(s, 40)) idx[t * K + j] = idx[t * K + (j + rnd_in(s, 1, K - 1)) % K];
        else idx[t * K + j] = (int32_t)PICK(s, -1, E, E + rnd_in(s, 1, 100), INT32_MIN, INT32_MAX);
      }
      break;
    case M_OTHER_TOKENS:
      if (T > 0) {
        int64_t n2 = rnd_in(s, 0, T - 1);
        *tokens = n2 >= k->n ? n2 + 1 : n2;
      }
      break;
    case M_SAVED_NEVER: k->bcall.saved = k->b[B_SAVED2].p; break;
    case M_SAVED_ROTATE: {
      const fz_rank_t* next = &wd->rk[(k->r + 1) % wd->W];
      k->bcall.saved = next->b[B_SAVED].p;
      k->bcall.saved_bytes = next->ba.saved_bytes;
      break;
    }
    case M_NUM: break;
  }
}

static void restore_idx(fz_world_t* wd) {
  if (wd->fused) return;
  for (int r = 0; r < wd->W; r++) {
    fz_rank_t* k = &wd->rk[r];
    memcpy(k->b[B_IDX].p, (const char*)wd->p->topk_idx + k->t0 * wd->K * 4, k->b[B_IDX].bytes);
  }
}

/* A call with broken arguments: on every rank alike (all fail on their own, or none
 * does), or (lone) on one rank, whose peers then wait for it and time out. Returns 0
 * when no mutation fitted. */
static int broken_call(fz_log_t* L, fz_world_t* wd, uint64_t* s, int backward, int lone) {
  const int W = wd->W;
  for (int tries = 0; tries < 30; tries++) {
    world_valid_args(wd);
    call_mutation_t m;
    do m = (call_mutation_t)rnd_in(s, 0, M_NUM - 1);
    while ((!backward && m >= M_OTHER_TOKENS) || (backward && m == M_IDX) || (m == M_IDX && wd->fused) ||
           (m == M_SAVED_ROTATE && W == 1));
    const int f = (int)rnd_in(s, 0, (backward ? kNumBwdFields : kNumFwdFields) - 1);
    const int victim = lone ? (int)rnd_in(s, 0, W - 1) : -1;
    for (int r = 0; r < W; r++)
      if (victim < 0 || r == victim) mutate_call(s, wd, &wd->rk[r], backward, m, f);
    int failing = 0, victim_fails = 0;
    for (int r = 0; r < W; r++) {
      fz_rank_t* k = &wd->rk[r];
      int empty, bad, maybe;
      if (backward) want_backward_local(k, &k->w, &empty, &bad, &maybe);
      else want_forward_local(k, &k->w, &empty);
      failing += k->w.n > 0;
      if (r == victim) victim_fails = k->w.n > 0;
    }
    if (lone ? failing == 1 && victim_fails : failing == 0 || failing == W) {
      char call[160];
      const char* fname = (backward ? kBwdFields : kFwdFields)[f].name;
      snprintf(call, sizeof call, "%s, %s%s%s%s", backward ? "mok_backward" : "mok_forward", kCallMutation[m],
               m == M_NULL || m == M_MISALIGN ? " (args->" : "", m == M_NULL || m == M_MISALIGN ? fname : "",
               m == M_NULL || m == M_MISALIGN ? ")" : "");
      if (lone) {
        const size_t at = strlen(call);
        snprintf(call + at, sizeof call - at, ", rank %d only", victim);
      }
      /* a NULL d_aux_loss or d_z_loss means 1: other values than the reference's */
      const char* fn = (backward ? kBwdFields : kFwdFields)[f].name;
      if (backward && m == M_NULL && !wd->pl.d_loss_null && strncmp(fn, "d_", 2) == 0 && strstr(fn, "loss"))
        wd->values_differ = 1;
      world_poison(wd);
      if (backward) world_backward(L, wd, call);
      else world_forward(L, wd, call);
      wd->values_differ = 0;
      restore_idx(wd);
      return 1;
    }
    restore_idx(wd);
  }
  return 0;
}

static void calls_iteration(fz_log_t* L, uint64_t seed) {
  uint64_t s = seed;
  fz_world_t* wd = calloc(1, sizeof *wd);
  if (!wd) abort();
  const int W = (int)PICK(&s, 1, 1, 1, 2, 2, 2, 3, 4, 4);
  random_plan(&s, W, &wd->pl);
  const int lone = W > 1 && pct(&s, 2), lone_backward = lone && pct(&s, 50);
  if (lone) wd->pl.timeout = 0.5; /* (its peers wait this long) */
  if (world_setup(L, wd, &s, lone ? "calls, one rank broken" : "calls")) goto done;
  if (lone && !lone_backward) {
    broken_call(L, wd, &s, 0, 1);
    goto destroy;
  }
  if (pct(&s, 60)) broken_call(L, wd, &s, 0, 0);
  world_valid_args(wd);
  world_poison(wd);
  world_forward(L, wd, "mok_forward");
  if (!all_succeeded(wd)) goto destroy;
  if (lone) {
    broken_call(L, wd, &s, 1, 1);
    goto destroy;
  }
  if (pct(&s, 60)) broken_call(L, wd, &s, 1, 0);
  world_valid_args(wd);
  world_poison(wd);
  world_backward(L, wd, "mok_backward");
  if (!all_succeeded(wd)) goto destroy;
  if (pct(&s, 35)) { /* KEEP: the same bits again (fp32: added again); REUSE: refused */
    world_valid_args(wd);
    world_poison(wd);
    world_backward(L, wd, "mok_backward again on the same saved");
  }
  if (pct(&s, 20)) { /* a second step on the same contexts */
    world_valid_args(wd);
    world_poison(wd);
    world_forward(L, wd, "mok_forward, step 2");
    if (!all_succeeded(wd)) goto destroy;
    world_valid_args(wd);
    world_poison(wd);
    world_backward(L, wd, "mok_backward, step 2");
  }
destroy:
  world_destroy_contexts(L, wd);
done:
  world_free(wd);
}

static int fuzz_calls(void) {
  fz_log_t L;
  log_begin(&L, 0.5);
  while (log_next(&L)) calls_iteration(&L, iteration_seed(&L));
  return log_end(&L, 1);
}

/* ---- case: saved ---- */

/* A small fixed world: H 16, F 8, Fs 8, fused softmax routing with both losses. */
static void fixed_plan(fz_plan_t* pl, int W, const int64_t* n, int64_t E, int64_t K, uint64_t seed) {
  memset(pl, 0, sizeof *pl);
  mok_config_t c = MOK_CONFIG_INIT;
  c.H = 16, c.F = 8, c.E = E, c.K = K, c.Fs = 8, c.W = W;
  c.use_bias_select = 1;
  c.aux_loss_coef = 0.01f;
  c.z_loss_coef = 0.001f;
  pl->W = W;
  pl->layer = c;
  for (int r = 0; r < W; r++) {
    pl->n[r] = n[r];
    pl->T[r] = n[r] + 8;
    pl->threads[r] = 1;
    pl->opt[r] = 0xffffu; /* every optional pointer given; the sizes exact (bits 16.. clear) */
  }
  pl->timeout = W > 1 ? 2.0 : 0.0;
  pl->ref_threads = 1;
  pl->data_seed = seed;
}

/* The world of a fixed plan after a valid forward, or NULL (failed, torn down). */
static fz_world_t* saved_world(fz_log_t* L, const fz_plan_t* pl, const char* what) {
  fz_world_t* wd = calloc(1, sizeof *wd);
  if (!wd) abort();
  wd->pl = *pl;
  uint64_t s = pl->data_seed;
  log_step(L, what);
  if (world_setup(L, wd, &s, what)) {
    world_free(wd);
    return NULL;
  }
  world_poison(wd);
  world_forward(L, wd, "mok_forward");
  if (!all_succeeded(wd)) {
    world_destroy_contexts(L, wd);
    world_free(wd);
    return NULL;
  }
  return wd;
}

static void world_end(fz_log_t* L, fz_world_t* wd) {
  world_destroy_contexts(L, wd);
  world_free(wd);
}

/* The valid backward, after a refused one: the failure left nothing behind. */
static void backward_again_valid(fz_log_t* L, fz_world_t* wd, const char* after) {
  char call[128];
  snprintf(call, sizeof call, "mok_backward with a good saved, after %s", after);
  world_valid_args(wd);
  world_poison(wd);
  world_backward(L, wd, call);
}

/* (a) bytes 512.. of one rank's saved overwritten with 0xFF (the header's used part
 * intact): refused on every rank. */
static void saved_ff_tail(fz_log_t* L, int W) {
  const int64_t n[] = {40, 24, 13};
  fz_plan_t pl;
  fixed_plan(&pl, W, n, W == 3 ? 6 : 8, 2, test_case_seed() ^ 0xa);
  char what[96];
  snprintf(what, sizeof what, "(a) W = %d: rank %d's saved bytes 512.. set to 0xFF", W, W - 1);
  fz_world_t* wd = saved_world(L, &pl, what);
  if (!wd) return;
  fz_rank_t* k = &wd->rk[W - 1];
  unsigned char* keep = malloc(k->sv_bytes);
  if (!keep) abort();
  memcpy(keep, k->b[B_SAVED].p, k->sv_bytes);
  memset(k->b[B_SAVED].p + 512, 0xFF, k->sv_bytes - 512);
  k->saved[0].state = SAVED_BAD;
  world_valid_args(wd);
  world_poison(wd);
  world_backward(L, wd, "mok_backward on it");
  memcpy(k->b[B_SAVED].p, keep, k->sv_bytes);
  k->saved[0].state = SAVED_OK;
  backward_again_valid(L, wd, "the refused one");
  free(keep);
  world_end(L, wd);
}

/* (c) context A writes saved and is destroyed; B (the same shape, or K = 2 for A's 8)
 * is created, perhaps at A's address: B's backward on A's saved is refused. */
static void saved_other_context(fz_log_t* L, int64_t K_b) {
  const int64_t n[] = {32};
  fz_plan_t pa, pb;
  fixed_plan(&pa, 1, n, 8, 8, test_case_seed() ^ 0xc);
  fixed_plan(&pb, 1, n, 8, K_b, test_case_seed() ^ 0xc);
  char what[128];
  snprintf(what, sizeof what, "(c) A (K = 8) writes saved, A destroyed, B (K = %lld) created: B's backward on it",
           (long long)K_b);
  fz_world_t* a = saved_world(L, &pa, what);
  if (!a) return;
  const size_t bytes = a->rk[0].sv_bytes;
  unsigned char* saved_a = aligned_alloc(256, rounded(bytes));
  unsigned char* copy = malloc(bytes);
  if (!saved_a || !copy) abort();
  memcpy(saved_a, a->rk[0].b[B_SAVED].p, bytes);
  memcpy(copy, saved_a, bytes);
  fz_world_t* b = calloc(1, sizeof *b);
  if (!b) abort();
  b->pl = pb;
  uint64_t s = pb.data_seed;
  log_step(L, what);
  describe_plan(L, b, what);
  if (world_reference(L, b)) goto out; /* (before A goes: nothing else allocates in between) */
  const void* address_a = a->rk[0].c.ctx;
  world_destroy_contexts(L, a);
  if (world_create(L, b, &s)) goto out;
  printf("    (c) K = %lld: B %s at A's freed address\n", (long long)K_b,
         (const void*)b->rk[0].c.ctx == address_a ? "is" : "is not");
  world_buffers(b, &b->rk[0]);
  world_valid_args(b);
  b->rk[0].bcall.saved = saved_a;
  b->rk[0].bcall.saved_bytes = bytes;
  world_poison(b);
  world_backward(L, b, "B's mok_backward on A's saved");
  if (memcmp(saved_a, copy, bytes) != 0) fz_fail(L, "changed a buffer it may not write", "A's saved changed");
  world_destroy_contexts(L, b);
out:
  world_destroy_contexts(L, a);
  world_free(b);
  world_free(a);
  free(saved_a);
  free(copy);
}

/* (d) a backward whose num_tokens is not its forward's: on every rank, or on one. */
static void saved_other_tokens(fz_log_t* L, int W, int only_last) {
  const int64_t n[] = {64, 20};
  fz_plan_t pl;
  fixed_plan(&pl, W, n, 8, 2, test_case_seed() ^ 0xd);
  char what[128];
  snprintf(what, sizeof what, "(d) W = %d: num_tokens of the backward not the forward's, on %s", W,
           only_last ? "the last rank" : "every rank");
  fz_world_t* wd = saved_world(L, &pl, what);
  if (!wd) return;
  world_valid_args(wd);
  for (int r = only_last ? W - 1 : 0; r < W; r++) wd->rk[r].bcall.num_tokens = wd->rk[r].n + 1 + r % 3;
  world_poison(wd);
  world_backward(L, wd, "mok_backward with another num_tokens");
  backward_again_valid(L, wd, "the refused one");
  world_end(L, wd);
}

/* Never written; another live context's (the same config); an older forward's (fine). */
static void saved_provenance(fz_log_t* L, int W) {
  const int64_t n[] = {48, 16, 5};
  fz_plan_t pl;
  fixed_plan(&pl, W, n, 8, 2, test_case_seed() ^ 0xe);
  char what[128];
  snprintf(what, sizeof what, "W = %d: rank 0's saved never written", W);
  fz_world_t* wd = saved_world(L, &pl, what);
  if (!wd) return;
  world_valid_args(wd);
  wd->rk[0].bcall.saved = wd->rk[0].b[B_SAVED2].p;
  world_poison(wd);
  world_backward(L, wd, "mok_backward on a saved no forward wrote");
  backward_again_valid(L, wd, "the refused one");
  snprintf(what, sizeof what, "W = %d: saved of an older forward of the same context", W);
  log_step(L, what);
  world_valid_args(wd);
  for (int r = 0; r < W; r++) wd->rk[r].fcall.saved = wd->rk[r].b[B_SAVED2].p;
  world_poison(wd);
  world_forward(L, wd, "mok_forward into the second saved");
  world_valid_args(wd);
  world_poison(wd);
  world_backward(L, wd, "mok_backward on the first forward's saved");
  for (int r = 0; r < W; r++) wd->rk[r].bcall.saved = wd->rk[r].b[B_SAVED2].p;
  world_poison(wd);
  world_backward(L, wd, "mok_backward on the second forward's saved");
  if (W == 1) {
    snprintf(what, sizeof what, "W = 1: saved of another live context of the same config");
    fz_world_t* other = saved_world(L, &pl, what);
    if (other) {
      world_valid_args(wd);
      wd->rk[0].bcall.saved = other->rk[0].b[B_SAVED].p;
      world_poison(wd);
      world_backward(L, wd, "mok_backward on the other context's saved");
      world_end(L, other);
    }
  }
  world_end(L, wd);
}

/* The header's fields one at a time, each refused; an unused T_all entry is not. */
static void saved_header_fields(fz_log_t* L, int W) {
  const int64_t n[] = {30, 50};
  fz_plan_t pl;
  fixed_plan(&pl, W, n, 8, 2, test_case_seed() ^ 0xf);
  char what[128];
  snprintf(what, sizeof what, "W = %d: header fields of the last rank's saved", W);
  fz_world_t* wd = saved_world(L, &pl, what);
  if (!wd) return;
  fz_rank_t* k = &wd->rk[W - 1];
  mok_saved_header_t* h = (mok_saved_header_t*)k->b[B_SAVED].p;
  const mok_saved_header_t keep = *h;
  struct {
    const char* name;
    int64_t* field;
    int64_t value;
    int bad;
  } cases[] = {
      {"magic", (int64_t*)&h->magic, (int64_t)(keep.magic ^ 1), 1},
      {"magic (used up)", (int64_t*)&h->magic, (int64_t)MOK_SAVED_USED, 1},
      {"context serial + 1", (int64_t*)&h->context_serial, (int64_t)keep.context_serial + 1, 1},
      {"context serial 0", (int64_t*)&h->context_serial, 0, 1},
      {"forward serial 0", (int64_t*)&h->serial, 0, 1},
      {"forward serial + 1", (int64_t*)&h->serial, (int64_t)keep.serial + 1, 1},
      {"T + 1", &h->T, keep.T + 1, 1},
      {"T = -1", &h->T, -1, 1},
      {"shape cfg.T", &h->shape[0], keep.shape[0] + 1, 1},
      {"shape H", &h->shape[1], keep.shape[1] * 2, 1},
      {"shape F", &h->shape[2], keep.shape[2] - 1, 1},
      {"shape E", &h->shape[3], keep.shape[3] + 8, 1},
      {"shape K", &h->shape[4], keep.shape[4] + 1, 1},
      {"shape Fs", &h->shape[5], 0, 1},
      {"shape W", &h->shape[6], keep.shape[6] + 1, 1},
      {"shape rank", &h->shape[7], keep.shape[7] + 1, 1},
      {"T_all of rank 0 + 1", &h->T_all[0], keep.T_all[0] + 1, 1},
      {"T_all of rank 0 = -5", &h->T_all[0], -5, 1},
      {"T_all of the last rank, of another count", &h->T_all[W - 1], keep.T_all[W - 1] ? 0 : 1, 1},
      {"T_all of no rank (unused)", &h->T_all[MOK_MAX_RANKS - 1], 12345, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    snprintf(what, sizeof what, "W = %d: the last rank's saved header, %s", W, cases[i].name);
    log_step(L, what);
    *cases[i].field = cases[i].value;
    k->saved[0].state = cases[i].bad ? SAVED_BAD : SAVED_EITHER;
    world_valid_args(wd);
    world_poison(wd);
    world_backward(L, wd, "mok_backward on it");
    *h = keep;
    k->saved[0].state = SAVED_OK;
    if (cases[i].bad) backward_again_valid(L, wd, "the refused one");
  }
  world_end(L, wd);
}

/* Do the ranks' backward outputs (those given) hold the W = 1 run's bits? */
static int world_backward_is_reference(const fz_world_t* wd) {
  static const int outputs[] = {B_DX, B_DTW, B_DWR, B_DBR, B_DW13, B_DW2, B_DB13, B_DB2, B_DWSG, B_DWS13, B_DWS2};
  int same = 1;
  for (int r = 0; r < wd->W && same; r++)
    for (int i = 0; i < (int)(sizeof outputs / sizeof outputs[0]) && same; i++) {
      const fz_rank_t* k = &wd->rk[r];
      const fz_buf_t* b = &k->b[outputs[i]];
      if (memcmp(b->p, b->before, b->bytes) == 0) continue; /* (not given) */
      void* tmp = calloc(1, b->bytes + 1);
      if (!tmp) abort();
      const void* ref = reference_of(wd, k, outputs[i], tmp);
      same = memcmp(b->p, ref, b->bytes) == 0;
      free(tmp);
    }
  return same;
}

/* (b) one random corruption of one rank's saved: of what the check covers (refused),
 * or of what it need not (the same bits, or finite ones for activations), or of another
 * rank's counts with their sum kept (docs/CPU.md checks sums and this rank's slots:
 * refused, or accepted with any values: counted). */
typedef enum {
  R_HEADER, R_HEADER_UNUSED, R_COUNTS, R_IDX, R_IDX_TAIL, R_POS, R_POS_TAIL, R_VALUES, R_COUNTS_PAIR, R_NUM
} corruption_t;
static const char* const kCorruption[] = {"a header field", "an unused header byte", "a count", "an expert index",
                                          "past the experts of the step", "a row position",
                                          "past the positions of the step", "activation bits",
                                          "another rank's counts, sum kept"};

static void saved_random_iteration(fz_log_t* L, uint64_t seed, int* pair_accepted, int* pair_wrong,
                                   int* pair_tried) {
  uint64_t s = seed;
  fz_world_t* wd = calloc(1, sizeof *wd);
  if (!wd) abort();
  const int W = (int)PICK(&s, 1, 1, 2, 2, 3);
  random_plan(&s, W, &wd->pl);
  wd->pl.layer.saved_use = MOK_SAVED_KEEP;
  for (int r = 0; r < W; r++) wd->pl.cap_mode[r] = 0;
  if (world_setup(L, wd, &s, "saved, random corruption")) goto done;
  world_poison(wd);
  world_forward(L, wd, "mok_forward");
  if (!all_succeeded(wd)) goto destroy;
  world_valid_args(wd);
  world_poison(wd);
  world_backward(L, wd, "mok_backward (clean)");
  if (!all_succeeded(wd)) goto destroy;
  {
    const int q = (int)rnd_in(&s, 0, W - 1);
    fz_rank_t* k = &wd->rk[q];
    mok_saved_plan_t sp;
    mok_plan_saved(k->c.ctx, k->c.cfg.T, &sp);
    unsigned char* sv = k->b[B_SAVED].p;
    const int64_t E = wd->E, K = wd->K, H = wd->H, nK = k->n * K;
    corruption_t what;
    do what = (corruption_t)rnd_in(&s, 0, R_NUM - 1);
    while ((what == R_IDX || what == R_POS || what == R_VALUES) && nK == 0);
    if (what == R_COUNTS_PAIR && W == 1) what = R_COUNTS;
    unsigned char* keep = malloc(k->sv_bytes);
    if (!keep) abort();
    memcpy(keep, sv, k->sv_bytes);
    int state = SAVED_BAD, values = 0;
    size_t at = 0; /* a byte, or a word at an int32 */
    int word = pct(&s, 50);
    int32_t value = 0;
    const size_t header = sizeof(mok_saved_header_t);
    switch (what) {
      case R_HEADER: {
        const size_t used = offsetof(mok_saved_header_t, T_all) + (size_t)W * 8;
        at = (size_t)rnd_in(&s, 0, (int64_t)used - 1);
        word = 0;
        break;
      }
      case R_HEADER_UNUSED:
        at = W < MOK_MAX_RANKS && (pct(&s, 50) || header == sp.counts_all)
                 ? offsetof(mok_saved_header_t, T_all) + (size_t)rnd_in(&s, W * 8, MOK_MAX_RANKS * 8 - 1)
                 : (size_t)rnd_in(&s, (int64_t)header, (int64_t)sp.counts_all - 1);
        state = SAVED_EITHER, word = 0;
        break;
      case R_COUNTS: {
        const int64_t i = rnd_in(&s, 0, W * E - 1);
        at = sp.counts_all + (size_t)i * 4;
        value = ((int32_t*)(sv + sp.counts_all))[i] + (int32_t)PICK(&s, 1, -1, 2, 1000);
        if (pct(&s, 30)) value = (int32_t)PICK(&s, -1, INT32_MAX, INT32_MIN);
        break;
      }
      case R_IDX: case R_POS: {
        const size_t base = what == R_IDX ? sp.topk_idx : sp.slot_pos;
        const int64_t i = rnd_in(&s, 0, nK - 1);
        const int32_t* arr = (const int32_t*)(sv + base);
        at = base + (size_t)i * 4;
        value = what == R_IDX ? (int32_t)PICK(&s, -1, E, INT32_MAX, INT32_MIN, (arr[i] + 1) % E, arr[(i + 1) % nK])
                              : (int32_t)PICK(&s, arr[i] + 1, arr[i] - 1, -1, INT32_MAX, arr[(i + 1) % nK], 0);
        if (value == arr[i]) value = -1;
        break;
      }
      case R_IDX_TAIL: case R_POS_TAIL: {
        const size_t base = what == R_IDX_TAIL ? sp.topk_idx : sp.slot_pos;
        const size_t end = what == R_IDX_TAIL ? sp.slot_pos : sp.topk_weight;
        if (base + (size_t)nK * 4 >= end) {
          what = R_HEADER_UNUSED, at = offsetof(mok_saved_header_t, T_all) + (size_t)W * 8, word = 0;
        } else {
          at = base + (size_t)rnd_in(&s, nK * 4, (int64_t)(end - base) - 1);
          word = word && (at - base) % 4 == 0 && at + 4 <= end;
          value = (int32_t)rnd(&s);
        }
        state = SAVED_EITHER;
        break;
      }
      case R_VALUES: { /* the low mantissa bits of an expert output, or of a weight */
        state = SAVED_EITHER, values = 1, word = 0;
        if (pct(&s, 50)) at = sp.o_slots + (size_t)rnd_in(&s, 0, nK * H - 1) * wd->act;
        else at = sp.topk_weight + (size_t)rnd_in(&s, 0, nK - 1) * wd->real;
        break;
      }
      case R_COUNTS_PAIR: {
        const int other = (q + (int)rnd_in(&s, 1, W - 1)) % W;
        int32_t* row = (int32_t*)(sv + sp.counts_all) + other * E;
        int64_t e2 = -1;
        for (int64_t e = 0; e < E; e++)
          if (row[e] > 0) e2 = e;
        if (e2 < 0 || E < 2) {
          what = R_COUNTS, at = sp.counts_all, value = row[0] - 1, word = 1;
          break;
        }
        const int64_t e1 = (e2 + rnd_in(&s, 1, E - 1)) % E;
        row[e1]++, row[e2]--;
        state = SAVED_EITHER, values = 2;
        (*pair_tried)++;
        break;
      }
      case R_NUM: break;
    }
    if (what != R_COUNTS_PAIR) {
      if (word) memcpy(sv + at, &value, 4);
      else if (what == R_VALUES) sv[at] ^= (unsigned char)rnd_in(&s, 1, 7);
      else sv[at] ^= (unsigned char)rnd_in(&s, 1, 255);
    }
    k->saved[0].state = state;
    wd->values_differ = values;
    char call[160];
    snprintf(call, sizeof call, "mok_backward on rank %d's saved with %s altered (%s at byte %zu)", q,
             kCorruption[what], word ? "int32" : "byte", at);
    world_valid_args(wd);
    world_poison(wd);
    world_backward(L, wd, call);
    for (int r = 1; r < W; r++)
      if (wd->rk[r].c.status != wd->rk[0].c.status)
        fz_fail(L, "ranks' saved verdicts differ", "%s: rank %d %s, rank 0 %s", call, r, sname(wd->rk[r].c.status),
                sname(wd->rk[0].c.status));
    if (what == R_COUNTS_PAIR && all_succeeded(wd)) {
      (*pair_accepted)++;
      *pair_wrong += !world_backward_is_reference(wd);
    }
    memcpy(sv, keep, k->sv_bytes);
    free(keep);
    k->saved[0].state = SAVED_OK;
    wd->values_differ = 0;
    backward_again_valid(L, wd, "it");
  }
destroy:
  world_destroy_contexts(L, wd);
done:
  world_free(wd);
}

static int fuzz_saved(void) {
  fz_log_t L;
  log_begin(&L, 0.3);
  for (int W = 1; W <= 2; W++) saved_ff_tail(&L, W);
  saved_ff_tail(&L, 3);
  saved_other_context(&L, 8);
  saved_other_context(&L, 2);
  saved_other_tokens(&L, 1, 0);
  saved_other_tokens(&L, 2, 0);
  saved_other_tokens(&L, 2, 1);
  saved_provenance(&L, 1);
  saved_provenance(&L, 2);
  saved_header_fields(&L, 1);
  saved_header_fields(&L, 2);
  const int deterministic_failed = L.failed;
  L.t0 = now_s();
  L.t_end = L.t0 + fuzz_seconds() * 0.3;
  int pair_accepted = 0, pair_wrong = 0, pair_tried = 0;
  while (log_next(&L)) saved_random_iteration(&L, iteration_seed(&L), &pair_accepted, &pair_wrong, &pair_tried);
  if (pair_tried)
    printf("    another rank's counts altered with their sum kept: %d of %d accepted, %d of those with other bits "
           "than the reference's\n", pair_accepted, pair_tried, pair_wrong);
  printf("    deterministic corruptions: %s\n", deterministic_failed ? "some failed (above)" : "all as expected");
  return log_end(&L, 1);
}

/* ---- case: empty_batch ---- */

static void empty_world(fz_log_t* L, int W, const int64_t* n, int fused, int accum, int outputs, const char* what) {
  fz_plan_t pl;
  fixed_plan(&pl, W, n, 8, 2, test_case_seed() ^ (uint64_t)(W * 64 + fused * 8 + accum * 2 + outputs));
  pl.layer.routing = fused ? MOK_ROUTING_FUSED : MOK_ROUTING_REPLAY;
  pl.layer.wgrad = accum ? MOK_WGRAD_FP32_ACCUM : MOK_WGRAD_BF16;
  if (!outputs)
    for (int r = 0; r < W; r++) pl.opt[r] &= ~(unsigned)(OPT_TPE | OPT_AUX | OPT_Z | OPT_IDX | OPT_DWR);
  fz_world_t* wd = calloc(1, sizeof *wd);
  if (!wd) abort();
  wd->pl = pl;
  uint64_t s = pl.data_seed;
  log_step(L, what);
  if (world_setup(L, wd, &s, what)) {
    world_free(wd);
    return;
  }
  world_poison(wd);
  world_backward(L, wd, "mok_backward before any forward");
  world_valid_args(wd);
  world_poison(wd);
  world_forward(L, wd, "mok_forward");
  world_valid_args(wd);
  world_poison(wd);
  world_backward(L, wd, "mok_backward");
  world_end(L, wd);
}

static int fuzz_empty_batch(void) {
  fz_log_t L;
  log_begin(&L, 0);
  const int64_t none[] = {0, 0}, one_empty[] = {0, 37};
  char what[128];
  for (int fused = 0; fused < 2; fused++)
    for (int accum = 0; accum < 2; accum++)
      for (int outputs = 0; outputs < 2; outputs++) {
        snprintf(what, sizeof what, "W = 1, num_tokens = 0, %s, %s weight gradients, %s", fused ? "fused" : "replay",
                 accum ? "fp32" : "bf16", outputs ? "every output given" : "no optional output");
        empty_world(&L, 1, none, fused, accum, outputs, what);
      }
  for (int accum = 0; accum < 2; accum++) {
    snprintf(what, sizeof what, "W = 2, no tokens on either rank (the W = 1 empty batch's bits), %s",
             accum ? "fp32" : "bf16");
    empty_world(&L, 2, none, 1, accum, 1, what);
  }
  empty_world(&L, 2, one_empty, 1, 0, 1, "W = 2, rank 0 without tokens");
  return log_end(&L, 0);
}

/* ---- case: timeouts ---- */

static void op_create_late(void* p) { /* rank 1 arrives 50 ms after rank 0 */
  fz_create_t* c = p;
  if (c->cfg.rank == 1) nanosleep(&(struct timespec){0, 50000000L}, NULL);
  op_create(p);
}

/* In the child: a W = 2 create and destroy with this timeout; exits 0 when both succeed. */
static void timeout_child(double timeout) {
  alarm(2);
  mok_cpu_comm_t* comm = NULL;
  if (mok_cpu_comm_create(2, &comm)) _exit(3);
  fz_create_t c[2];
  memset(c, 0, sizeof c);
  for (int r = 0; r < 2; r++) {
    mok_config_t* g = &c[r].cfg;
    *g = (mok_config_t)MOK_CONFIG_INIT;
    g->T = 8, g->H = 4, g->F = 4, g->E = 2, g->K = 1, g->W = 2, g->rank = r;
    g->cpu_comm = comm;
    g->num_threads = 1;
    g->comm_timeout_s = timeout;
  }
  on_ranks(2, op_create_late, c, sizeof c[0]);
  for (int r = 0; r < 2; r++)
    if (c[r].status) {
      printf("      rank %d: %s: %s\n", r, sname(c[r].status), c[r].msg);
      fflush(stdout);
      _exit(1);
    }
  on_ranks(2, op_destroy, c, sizeof c[0]);
  _exit(c[0].status || c[1].status ? 2 : 0);
}

/* mok.h bounds every wait by cfg.comm_timeout_s, any finite value >= 0 being valid. */
static int fuzz_timeouts(void) {
  fz_log_t L;
  log_begin(&L, 0);
  const double timeouts[] = {1e10, 9.3e18, DBL_MAX};
  for (int i = 0; i < 3; i++) {
    char what[96];
    snprintf(what, sizeof what, "W = 2 create, rank 1 50 ms late, comm_timeout_s = %g", timeouts[i]);
    log_step(&L, what);
    fflush(stdout);
    const pid_t pid = fork();
    if (pid < 0) {
      fz_fail(&L, "fork", "fork failed");
      continue;
    }
    if (pid == 0) timeout_child(timeouts[i]);
    int st = 0;
    waitpid(pid, &st, 0);
    if (WIFSIGNALED(st))
      fz_fail(&L, "a wait that never ends", "no return after 2 s (the child was stopped by signal %d)", WTERMSIG(st));
    else if (WEXITSTATUS(st))
      fz_fail(&L, "a valid timeout refused", "the child exited with %d (a rank's create or destroy failed)",
              WEXITSTATUS(st));
  }
  return log_end(&L, 0);
}

const test_case_t suite_fuzz[] = {
    {"create", fuzz_create},
    {"calls", fuzz_calls},
    {"saved", fuzz_saved},
    {"empty_batch", fuzz_empty_batch},
    {"timeouts", fuzz_timeouts},
    TEST_END,
};
